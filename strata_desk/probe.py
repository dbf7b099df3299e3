"""The machine as setup sees it: GPUs (through the server's NVML probe), RAM and CPU."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil

from server.hardware import probe_gpus

GIB = 1 << 30
MIB = 1 << 20


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
    gpus = [GpuInfo(g.index, g.name, g.total_mib * MIB / GIB) for g in probe_gpus()]
    return HardwareInfo(
        gpus=gpus,
        ram_gib=psutil.virtual_memory().total / GIB,
        cpu_name=_cpu_name(),
        cpu_cores=psutil.cpu_count(logical=False) or os.cpu_count() or 0,
    )
