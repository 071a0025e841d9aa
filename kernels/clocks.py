"""SM clock, board power and throttle reasons while a benchmark runs, sampled by ``nvidia-smi``.

A kernel's time on a GPU that sits at its power limit says as much about the energy its work takes
as about its schedule: on the H200 of docs/benchmarks.md both cuDNN's BF16 attention and ``sagebwd``
run at the 700 W cap (nvidia-smi's "SW power cap"), at different clocks. :class:`ClockSampler`
records that beside the timings (``python -m attnqat.kernels.sagebwd_bench --clocks``)::

    with ClockSampler() as clk:
        ms = _bench(fn, rep_ms)
    clk.summary   # {"sm_mhz": 1890.0, "power_w": 691.2, "samples": 61, "throttle": ["sw_power_cap"]}

Where ``nvidia-smi`` cannot be run, :attr:`ClockSampler.summary` is None and
:attr:`ClockSampler.unavailable` says why (the timings are still taken).
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile

#: nvmlClocksThrottleReasons bits (NVML's names, snake_case)
THROTTLE_REASONS = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting",
}
QUERY = "clocks.sm,power.draw,clocks_throttle_reasons.active"


def throttle_names(mask: int) -> list[str]:
    """The reasons set in an NVML throttle bitmask (unknown bits as hex)."""
    names = [name for bit, name in THROTTLE_REASONS.items() if mask & bit]
    rest = mask & ~sum(THROTTLE_REASONS)
    return names + ([hex(rest)] if rest else [])


def parse(text: str) -> dict | None:
    """Median SM clock (MHz) and power (W), the number of samples and every throttle reason seen,
    from ``nvidia-smi --query-gpu=`` :data:`QUERY` ``--format=csv,noheader`` lines (one GPU's);
    None when no line parses."""
    mhz, watts, mask = [], [], 0
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            continue
        try:
            m = float(parts[0].split()[0])
            w = float(parts[1].split()[0])
            r = int(parts[2], 16)
        except (ValueError, IndexError):
            continue   # "[N/A]", a warning line
        mhz.append(m)
        watts.append(w)
        mask |= r
    if not mhz:
        return None
    return {"sm_mhz": statistics.median(mhz), "power_w": round(statistics.median(watts), 1),
            "samples": len(mhz), "throttle": throttle_names(mask)}


def smi_id(device=None) -> str:
    """nvidia-smi's ``--id`` of a CUDA device: its PCI address where torch reports it (so that
    CUDA_VISIBLE_DEVICES cannot point the sampler at another GPU), else its CUDA index."""
    import torch  # noqa: PLC0415

    index = torch.cuda.current_device() if device is None else torch.device(device).index or 0
    props = torch.cuda.get_device_properties(index)
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return str(index)
    return f"{getattr(props, 'pci_domain_id', 0):08X}:{bus:02X}:{getattr(props, 'pci_device_id', 0):02X}.0"


class ClockSampler:
    """Samples GPU ``gpu`` (nvidia-smi's ``--id``: an index or PCI address, :func:`smi_id`) every
    ``interval_ms`` while the ``with`` block runs; afterwards
    :attr:`summary` is :func:`parse`'s result (None, with :attr:`unavailable` set, where nvidia-smi
    is missing or printed nothing)."""

    def __init__(self, gpu: str = "0", interval_ms: int = 50):
        self.gpu, self.interval_ms = gpu, interval_ms
        self.summary: dict | None = None
        self.unavailable: str | None = None
        self._proc = None
        self._log = None

    def __enter__(self):
        exe = shutil.which("nvidia-smi")
        if exe is None:
            self.unavailable = "nvidia-smi is not on PATH: clocks and power not sampled"
            return self
        self._log = tempfile.TemporaryFile(mode="w+")
        self._proc = subprocess.Popen(
            [exe, f"--id={self.gpu}", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
             f"--loop-ms={self.interval_ms}"], stdout=self._log, stderr=subprocess.STDOUT, text=True)
        return self

    def __exit__(self, *exc):
        if self._proc is None:
            return False
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._log.seek(0)
        text = self._log.read()
        self._log.close()
        self.summary = parse(text)
        if self.summary is None:
            self.unavailable = f"nvidia-smi printed no sample: {text.strip()[:200]!r}"
        return False


def describe(summary: dict | None) -> str:
    """One line for a table: "1890 MHz, 691 W, sw_power_cap" (or "clocks not sampled")."""
    if summary is None:
        return "clocks not sampled"
    reasons = [r for r in summary["throttle"] if r != "gpu_idle"]
    return f"{summary['sm_mhz']:.0f} MHz, {summary['power_w']:.0f} W, {', '.join(reasons) or 'not throttled'}"
