"""Probing the machine: GPUs through NVML (nvidia-ml-py) where present, the host through psutil.

`probe_gpus()` returns [] without an NVIDIA driver; nothing here raises. Used by /metrics and by the
setup code (strata_desk) for its recommendation.

PCIe traffic: NVML counts a GPU's PCIe bytes over 20 ms per call, blocking, so a call per GPU and
direction would hold up the server's event loop at every /metrics. `PcieSampler` reads them on a
daemon thread instead, woken by each probe; a probe gives the figures the previous one asked for.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import psutil

from server.metrics_schema import GpuInfo, HostInfo

_MIB = 1 << 20
_lock = threading.Lock()
_nvml_state: bool | None = None  # None: not tried yet


class PcieSampler:
    """Each GPU's PCIe throughput (MiB/s: to the GPU, from it), read on a daemon thread when asked."""

    def __init__(self, nv: Any) -> None:  # the pynvml module (or a stand-in)
        self.nv = nv
        self.last: dict[int, tuple[float, float]] = {}  # GPU index -> (to the GPU, from it)
        self._asked: list[tuple[int, object]] = []
        self._wake = threading.Event()
        self._failed: set[int] = set()  # GPUs without the counters (virtual GPUs, old drivers)
        threading.Thread(target=self._run, name="pcie-sampler", daemon=True).start()

    def ask(self, handles: list[tuple[int, object]]) -> None:
        """Read these GPUs' counters in the background (the next probe sees them)."""
        self._asked = handles
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            for index, handle in self._asked:
                if index in self._failed:
                    continue
                try:
                    kb_to = self.nv.nvmlDeviceGetPcieThroughput(handle, self.nv.NVML_PCIE_UTIL_RX_BYTES)
                    kb_from = self.nv.nvmlDeviceGetPcieThroughput(handle, self.nv.NVML_PCIE_UTIL_TX_BYTES)
                except Exception:
                    self._failed.add(index)
                    continue
                self.last[index] = (kb_to / 1024, kb_from / 1024)


_pcie: PcieSampler | None = None


def _nvml():
    global _nvml_state
    with _lock:
        if _nvml_state is False:
            return None
        try:
            import pynvml

            if _nvml_state is None:
                pynvml.nvmlInit()
                _nvml_state = True
            return pynvml
        except Exception:
            _nvml_state = False
            return None


def probe_gpus() -> list[GpuInfo]:
    nv = _nvml()
    if nv is None:
        return []
    global _pcie
    out: list[GpuInfo] = []
    handles: list[tuple[int, object]] = []
    try:
        count = nv.nvmlDeviceGetCount()
    except Exception:
        return []
    for i in range(count):
        try:
            h = nv.nvmlDeviceGetHandleByIndex(i)
            handles.append((i, h))
            name = nv.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else str(name)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            info = GpuInfo(index=i, name=name, total_mib=mem.total / _MIB, used_mib=mem.used / _MIB,
                           free_mib=mem.free / _MIB)
        except Exception:
            continue
        with contextlib.suppress(Exception):
            info.util_pct = float(nv.nvmlDeviceGetUtilizationRates(h).gpu)
        with contextlib.suppress(Exception):
            info.temp_c = float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
        with contextlib.suppress(Exception):
            info.power_w = nv.nvmlDeviceGetPowerUsage(h) / 1000.0
        with contextlib.suppress(Exception):
            info.power_limit_w = nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0
        if _pcie is not None and i in _pcie.last:
            info.pcie_to_mib_s, info.pcie_from_mib_s = (round(v, 1) for v in _pcie.last[i])
        out.append(info)
    if handles:
        with _lock:
            if _pcie is None:
                _pcie = PcieSampler(nv)
        _pcie.ask(handles)
    return out


def probe_host(engine_pid: int | None = None) -> HostInfo:
    vm = psutil.virtual_memory()
    info = HostInfo(cpu_pct=psutil.cpu_percent(interval=None), cpu_count=psutil.cpu_count() or 0,
                    ram_total_mib=vm.total / _MIB, ram_used_mib=(vm.total - vm.available) / _MIB,
                    ram_available_mib=vm.available / _MIB)
    if engine_pid:
        with contextlib.suppress(Exception):
            info.engine_rss_mib = psutil.Process(engine_pid).memory_info().rss / _MIB
    return info
