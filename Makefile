# Set-up and the two commands of the README. `make test` and `make app` each create the virtual
# environment on first use (CPU PyTorch 2.13.0 unless a torch is already importable there), so one
# command is all a fresh machine needs.
VENV       ?= .venv
PYTHON     ?= python3
TORCH_SPEC ?= torch==2.13.0
PY          = $(VENV)/bin/python
STAMP       = $(VENV)/.attnqat-installed

.PHONY: setup test test-fast test-gpu app browser clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	@touch $@

setup: $(STAMP) browser

# Debian's Chromium drives the browser tests (Playwright uses it; it never downloads a browser).
# apt waits up to APT_LOCK_WAIT seconds for a lock another process holds (an unattended upgrade,
# another install), and a failed attempt is tried once more after APT_RETRY_PAUSE seconds.
BROWSER_BIN     ?= chromium
APT_LOCK_WAIT   ?= 600
APT_RETRY_PAUSE ?= 20
APT_GET          = apt-get -o DPkg::Lock::Timeout=$(APT_LOCK_WAIT)
browser:
	@command -v $(BROWSER_BIN) >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" != 0 ]; then \
	    echo "make: Chromium is missing; install Debian's 'chromium' package (browser tests need it)"; \
	  else \
	    for attempt in 1 2; do \
	      $(APT_GET) update -qq && DEBIAN_FRONTEND=noninteractive $(APT_GET) install -y -qq chromium >/dev/null && break; \
	      if [ $$attempt = 2 ]; then echo "make: installing chromium failed twice" >&2; exit 1; fi; \
	      echo "make: apt-get failed (another process may hold its lock); trying once more in $(APT_RETRY_PAUSE) s" >&2; \
	      sleep $(APT_RETRY_PAUSE); \
	    done; \
	  fi; }

# PyTorch's intra-op threads in the tests (`make test TEST_THREADS=2` for two). One: on the 2-core
# machine shared with other work, two threads made the torch-bound tests 5-10x slower
# (docs/development.md, "Tests"); the servers the tests start inherit it.
TEST_THREADS ?= 1

# pytest-xdist workers (`make test TEST_JOBS=0` runs in one process). Two on the 2-core machine:
# the CPU-bound tests run 1.7-1.8x faster (docs/development.md, "Tests"). Each test goes to
# whichever worker is free (`--dist load`); a module-scoped fixture is made once per worker that
# runs one of its tests.
TEST_JOBS  ?= 2
TEST_XDIST  = -n $(TEST_JOBS) --dist load

test: setup
	OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest -q $(TEST_XDIST)

# The inner loop (docs/development.md, "Tests"): everything but what is marked as running Triton
# kernels through the interpreter, starting servers or commands as child processes (kill and
# resume included), driving the browser, or slow; none of it needs Chromium.
FAST_MARKERS ?= not gpu and not slow and not browser and not interpreter and not subprocess
test-fast: $(STAMP)
	OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest -q -m "$(FAST_MARKERS)" $(TEST_XDIST)

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu

app: $(STAMP)
	$(VENV)/bin/attnqat app

clean:
	rm -rf $(VENV)
