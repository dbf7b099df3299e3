"""Probing the machine: GPUs through NVML (nvidia-ml-py) where present, the host through psutil.

`probe_gpus()` returns [] without an NVIDIA driver; nothing here raises. Used by /metrics and by the
setup code (strata_desk) for its recommendation.
"""

from __future__ import annotations

import contextlib
import threading

import psutil

from server.metrics_schema import GpuInfo, HostInfo

_MIB = 1 << 20
_lock = threading.Lock()
_nvml_state: bool | None = None  # None: not tried yet


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
    out: list[GpuInfo] = []
    try:
        count = nv.nvmlDeviceGetCount()
    except Exception:
        return []
    for i in range(count):
        try:
            h = nv.nvmlDeviceGetHandleByIndex(i)
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
        out.append(info)
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
