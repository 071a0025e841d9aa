"""kernels/clocks.py: nvidia-smi samples parsed, and the sampler run against a stand-in nvidia-smi
(CPU; the real one runs with ``sagebwd_bench --clocks`` on the GPU machine)."""

import os
import stat
import time

from attnqat.kernels import clocks as kc


def test_parse_takes_medians_and_every_throttle_reason():
    text = "\n".join([
        "1680, 690.21, 0x0000000000000004",
        "1710, 688.00, 0x0000000000000000",
        "[N/A], [N/A], [N/A]",            # a sample nvidia-smi could not take
        "1695 MHz, 691.50 W, 0x0000000000000024",
        "Failed to query something",
    ])
    got = kc.parse(text)
    assert got == {"sm_mhz": 1695.0, "power_w": 690.2, "samples": 3,
                   "throttle": ["sw_power_cap", "sw_thermal_slowdown"]}
    assert kc.describe(got) == "1695 MHz, 690 W, sw_power_cap, sw_thermal_slowdown"
    assert kc.parse("") is None and kc.parse("No devices were found") is None
    assert kc.describe(None) == "clocks not sampled"


def test_throttle_names_keep_unknown_bits():
    assert kc.throttle_names(0) == []
    assert kc.throttle_names(0x1 | 0x80) == ["gpu_idle", "hw_power_brake_slowdown"]
    assert kc.throttle_names(0x4 | 0x2000) == ["sw_power_cap", "0x2000"]
    assert kc.describe({"sm_mhz": 1980, "power_w": 80.0, "samples": 1, "throttle": ["gpu_idle"]}) == \
        "1980 MHz, 80 W, not throttled"


def _fake_smi(tmp_path, body: str):
    exe = tmp_path / "nvidia-smi"
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(tmp_path)


def test_sampler_reads_what_nvidia_smi_prints(tmp_path, monkeypatch):
    # the stand-in checks the arguments the sampler passes, then prints a sample every 10 ms
    body = ('case "$*" in *--id=0000000A:1B:00.0*--query-gpu=' + kc.QUERY + '*--loop-ms=20*) ;; '
            '*) echo "bad arguments: $*"; exit 1;; esac\n'
            'while true; do echo "1890, 691.00, 0x0000000000000004"; sleep 0.01; done\n')
    monkeypatch.setenv("PATH", _fake_smi(tmp_path, body) + os.pathsep + os.environ["PATH"])
    with kc.ClockSampler("0000000A:1B:00.0", interval_ms=20) as clk:
        time.sleep(0.3)
    assert clk.unavailable is None
    assert clk.summary["sm_mhz"] == 1890.0 and clk.summary["power_w"] == 691.0
    assert clk.summary["samples"] >= 2 and clk.summary["throttle"] == ["sw_power_cap"]


def test_sampler_says_why_when_it_has_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))   # no nvidia-smi at all
    with kc.ClockSampler() as clk:
        pass
    assert clk.summary is None and "not on PATH" in clk.unavailable
    monkeypatch.setenv("PATH", _fake_smi(tmp_path, 'echo "NVIDIA-SMI has failed"\n'))
    with kc.ClockSampler() as clk:
        time.sleep(0.1)
    assert clk.summary is None and "NVIDIA-SMI has failed" in clk.unavailable
