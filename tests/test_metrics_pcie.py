"""PCIe traffic per GPU: NVML's counters (each reading blocks for its 20 ms sample) are read on the
sampler's thread, so a probe never waits and gives the figures the previous probe asked for; a GPU
without the counters shows none and is not asked again; the GPU card and Prometheus show them.
NVML is a stand-in here (no GPU on CI)."""

from __future__ import annotations

import threading
import time

from server import hardware
from tui import preview
from tui.widgets.gpu_card import pcie_text


class FakeMemory:
    total, used, free = 24 << 30, 20 << 30, 4 << 30


class FakeNvml:
    """pynvml's calls that probe_gpus makes: GPU 0 has PCIe counters, GPU 1 (a virtual GPU) has none."""

    NVML_TEMPERATURE_GPU = 0
    NVML_PCIE_UTIL_TX_BYTES = 0
    NVML_PCIE_UTIL_RX_BYTES = 1

    def __init__(self) -> None:
        self.reads = {0: 0, 1: 0}
        self.sampled = threading.Event()  # NVML's 20 ms sample, held until the test lets it end

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> str:
        return f"GPU {h}"

    def nvmlDeviceGetMemoryInfo(self, h: int) -> FakeMemory:
        return FakeMemory()

    def nvmlDeviceGetPcieThroughput(self, h: int, counter: int) -> int:
        self.reads[h] += 1
        if h == 1:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        assert self.sampled.wait(5)
        return 2048 * 1024 if counter == self.NVML_PCIE_UTIL_RX_BYTES else 40 * 1024  # KB/s


def test_pcie_sampled_off_the_probe(monkeypatch) -> None:
    nv = FakeNvml()
    monkeypatch.setattr(hardware, "_nvml", lambda: nv)
    monkeypatch.setattr(hardware, "_pcie", None)
    first = hardware.probe_gpus()  # returns while the sample is still being taken
    assert [(g.pcie_to_mib_s, g.pcie_from_mib_s) for g in first] == [(None, None), (None, None)]
    nv.sampled.set()
    sampler = hardware._pcie
    deadline = time.monotonic() + 5
    while 0 not in sampler.last and time.monotonic() < deadline:
        time.sleep(0.01)
    second = hardware.probe_gpus()
    assert (second[0].pcie_to_mib_s, second[0].pcie_from_mib_s) == (2048.0, 40.0)
    assert (second[1].pcie_to_mib_s, second[1].pcie_from_mib_s) == (None, None)
    deadline = time.monotonic() + 5
    while nv.reads[0] < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert nv.reads == {0: 4, 1: 1}  # asked twice; the GPU without counters only once
    assert hardware._pcie is sampler  # one sampler thread


def test_gpu_card_shows_pcie() -> None:
    gpu = preview.idle().devices[0]
    assert pcie_text(gpu).plain == ""  # no counters
    gpu.pcie_to_mib_s, gpu.pcie_from_mib_s = 2048.0, 40.0
    assert pcie_text(gpu).plain == "PCIe to GPU 2.0 GiB/s  from GPU 40 MiB/s"
