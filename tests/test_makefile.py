"""The Makefile's Chromium step (``make browser``, part of ``make test``): apt waits for a lock
that another process holds and a failed attempt is tried once more. apt-get is replaced by a
script on PATH that records its arguments; nothing is installed."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.subprocess, pytest.mark.skipif(shutil.which("make") is None or os.geteuid() != 0,
                                reason="needs make, and root (the step installs only as root)")]


def run_browser_step(tmp_path: Path, failures: int) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``make browser`` with a fake apt-get that fails its first ``failures`` calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.log"
    fake = bin_dir / "apt-get"
    fake.write_text(f"""#!/bin/sh
echo "$*" >> {calls}
n=$(wc -l < {calls})
[ "$n" -gt {failures} ] || {{ echo "E: Could not get lock /var/lib/dpkg/lock-frontend" >&2; exit 100; }}
""")
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    done = subprocess.run(["make", "-s", "-C", str(ROOT), "browser", "BROWSER_BIN=no-such-browser",
                           "APT_RETRY_PAUSE=0", "APT_LOCK_WAIT=7"],
                          env=env, capture_output=True, text=True, timeout=60)
    return done, calls.read_text().splitlines() if calls.exists() else []


def test_apt_waits_for_the_lock_and_succeeds_first_time(tmp_path):
    done, calls = run_browser_step(tmp_path, failures=0)
    assert done.returncode == 0, done.stderr
    assert calls == ["-o DPkg::Lock::Timeout=7 update -qq",
                     "-o DPkg::Lock::Timeout=7 install -y -qq chromium"]


def test_a_failed_attempt_is_tried_once_more(tmp_path):
    done, calls = run_browser_step(tmp_path, failures=1)
    assert done.returncode == 0, done.stderr
    assert "trying once more" in done.stderr
    assert calls[0].endswith("update -qq") and calls[1:] == [calls[0], calls[0].replace(
        "update -qq", "install -y -qq chromium")]


def test_two_failures_stop_make_with_a_message(tmp_path):
    done, calls = run_browser_step(tmp_path, failures=5)
    assert done.returncode != 0
    assert "installing chromium failed twice" in done.stderr
    assert len(calls) == 2  # one update per attempt, no third attempt


def test_test_fast_leaves_out_only_registered_markers_and_test_runs_everything():
    """``make test-fast`` deselects the markers docs/development.md lists, each registered in
    pyproject.toml (a misspelt marker would deselect nothing); ``make test`` deselects nothing
    but the GPU tests (pyproject's addopts)."""
    import re
    import tomllib

    def recipe(target: str) -> str:
        done = subprocess.run(["make", "-s", "-n", "-C", str(ROOT), target], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return [line for line in done.stdout.splitlines() if "-m pytest" in line][-1]

    fast = recipe("test-fast")
    expr = re.search(r'-m pytest -q -m "([^"]+)"', fast).group(1)
    left_out = set(re.findall(r"not (\w+)", expr))
    assert left_out == {"gpu", "slow", "browser", "interpreter", "subprocess"}
    assert expr == " and ".join(f"not {m}" for m in re.findall(r"not (\w+)", expr))
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert left_out <= {m.split(":")[0] for m in ini["markers"]}
    # both spread the tests over pytest-xdist workers; `make test` selects by no marker
    xdist = "-n 2 --dist load"
    assert fast.endswith(f'-m "{expr}" {xdist}')
    assert recipe("test").endswith(f"-m pytest -q {xdist}")
