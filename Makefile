# Set-up and the two commands of the README. `make test` and `make app` each create the virtual
# environment on first use (CPU PyTorch 2.13.0 unless a torch is already importable there), so one
# command is all a fresh machine needs.
VENV       ?= .venv
PYTHON     ?= python3
TORCH_SPEC ?= torch==2.13.0
PY          = $(VENV)/bin/python
STAMP       = $(VENV)/.attnqat-installed

.PHONY: setup test test-gpu app browser clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	@touch $@

setup: $(STAMP) browser

# Debian's Chromium drives the browser tests (Playwright uses it; it never downloads a browser).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "make: Chromium is missing; install Debian's 'chromium' package (browser tests need it)"; fi; }

test: setup
	$(PY) -m pytest -q

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu

app: $(STAMP)
	$(VENV)/bin/attnqat app

clean:
	rm -rf $(VENV)
