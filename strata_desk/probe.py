"""The machine as setup sees it: GPUs (server.hardware when present, else NVML), RAM and CPU."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil

GIB = 1 << 30


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    vram_gib: float


@dataclass(frozen=True)
class HardwareInfo:
    gpus: list[GpuInfo] = field(default_factory=list)
    ram_gib: float = 0.0
    cpu_name: str = ""
    cpu_cores: int = 0

    @property
    def gpu_vram_gib(self) -> list[float]:
        return [g.vram_gib for g in self.gpus]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self) -> list[str]:
        out = [f"GPU {g.index}: {g.name}, {g.vram_gib:.1f} GiB" for g in self.gpus]
        if not self.gpus:
            out.append("no NVIDIA GPU found")
        out.append(f"RAM {self.ram_gib:.1f} GiB; CPU {self.cpu_name or 'unknown'}, {self.cpu_cores} cores")
        return out


def _field(obj: Any, *names: str) -> Any:
    for name in names:
        if isinstance(obj, dict) and name in obj:
            return obj[name]
        if hasattr(obj, name):
            return getattr(obj, name)
    return None


def _gpus_from_server() -> list[GpuInfo] | None:
    """Use the server's probe when it is there; None when it is not (or gives nothing usable)."""
    try:
        from server.hardware import probe_gpus  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        found = list(probe_gpus())
    except Exception:  # noqa: BLE001 - a broken probe must not stop setup; NVML is the fallback
        return None
    out = []
    for i, gpu in enumerate(found):
        total = _field(gpu, "total_bytes", "memory_total", "vram_total", "total", "mem_total")
        if total is None:
            mib = _field(gpu, "total_mib", "memory_total_mib", "vram_total_mib")
            total = None if mib is None else float(mib) * (1 << 20)
        if total is None:
            return None
        index = _field(gpu, "index")
        name = _field(gpu, "name") or "GPU"
        out.append(GpuInfo(int(index if index is not None else i), str(name), float(total) / GIB))
    return out


def _gpus_from_nvml() -> list[GpuInfo]:
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - pynvml raises NVMLError subclasses: no driver, no GPU
        return []
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else str(name)
            total = pynvml.nvmlDeviceGetMemoryInfo(handle).total
            out.append(GpuInfo(i, name, total / GIB))
        return out
    finally:
        pynvml.nvmlShutdown()


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor()


def probe_hardware() -> HardwareInfo:
    """Probe GPUs, RAM and CPU. Never raises: missing pieces read as none/unknown."""
    gpus = _gpus_from_server()
    if gpus is None:
        gpus = _gpus_from_nvml()
    return HardwareInfo(
        gpus=gpus,
        ram_gib=psutil.virtual_memory().total / GIB,
        cpu_name=_cpu_name(),
        cpu_cores=psutil.cpu_count(logical=False) or os.cpu_count() or 0,
    )
