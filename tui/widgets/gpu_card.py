"""One GPU: a VRAM bar split into weights, expert cache, slot sessions, KV, other and free, with
util, temperature, power and its PCIe traffic."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

from server.metrics_schema import GpuInfo
from tui.format import count, mib
from tui.widgets.quiet import update_text
from tui.widgets.segment_bar import Segment, SegmentBar

PARTS = (
    ("weights", "weights_mib", "dodger_blue2"),
    ("experts", "experts_mib", "medium_purple2"),
    ("slots", "slots_mib", "gold3"),
    ("KV", "kv_mib", "green3"),
    ("other", "other_mib", "grey50"),
)
FREE_STYLE = "grey23"


def gpu_segments(gpu: GpuInfo) -> list[Segment]:
    segs: list[Segment] = []
    if gpu.split is not None:
        accounted = 0.0
        for label, attr, style in PARTS:
            value = getattr(gpu.split, attr) or 0.0
            accounted += value
            segs.append(Segment(label, value, style))
        free = gpu.split.free_mib if gpu.split.free_mib is not None else gpu.free_mib
        if gpu.split.other_mib is None:
            other = max(0.0, gpu.total_mib - free - accounted)
            segs[-1] = Segment("other", other, "grey50")
    else:
        segs.append(Segment("used", gpu.used_mib, "grey62"))
        free = gpu.free_mib
    segs.append(Segment("free", max(0.0, free), FREE_STYLE, "░"))
    return segs


def legend(segs: list[Segment], expert_slots: int | None = None) -> Text:
    """Each part's size; with the GPU expert tier the experts are its cache, with its slots."""
    text = Text()
    for seg in segs:
        if seg.value <= 0 and seg.label not in ("free",):
            continue
        text.append("■ ", style=seg.style if seg.label != "free" else "grey50")
        if seg.label == "experts" and expert_slots is not None:
            text.append(f"expert cache {mib(seg.value)} ({count(expert_slots)} experts)  ")  # a slot holds one
        else:
            text.append(f"{seg.label} {mib(seg.value)}  ")
    return text


class GpuCard(Vertical):
    DEFAULT_CSS = """
    GpuCard { height: auto; margin-bottom: 0; }
    GpuCard .gpu-title { height: 1; }
    GpuCard .gpu-legend { height: auto; color: $text-muted; }
    """

    def compose(self) -> ComposeResult:
        yield Static("", classes="gpu-title")
        yield SegmentBar(empty="no memory figures")
        yield Static("", classes="gpu-legend")

    def show(self, gpu: GpuInfo) -> None:
        update_text(self.query_one(".gpu-title", Static), gpu_title(gpu))
        segs = gpu_segments(gpu)
        self.query_one(SegmentBar).segments = tuple(segs)
        text = legend(segs, gpu.split.expert_slots if gpu.split is not None else None)
        if pcie := pcie_text(gpu):
            text.rstrip()
            text.append("\n")
            text.append_text(pcie)
        update_text(self.query_one(".gpu-legend", Static), text)


def gpu_title(gpu: GpuInfo) -> Text:
    """`GPU0 H200  30.1 GiB / 140 GiB  layers 0-23  util 87%  61°C  410/700 W`."""
    title = Text()
    title.append(f"GPU{gpu.index} ", style="bold")
    title.append(f"{gpu.name}  ")
    title.append(f"{mib(gpu.used_mib)} / {mib(gpu.total_mib)}", style="bold")
    if gpu.split is not None and gpu.split.layers:
        title.append(f"  layers {gpu.split.layers}", style="bold cyan")
    if gpu.util_pct is not None:
        title.append(f"  util {gpu.util_pct:.0f}%")
    if gpu.temp_c is not None:
        title.append(f"  {gpu.temp_c:.0f}°C", style="bold red" if gpu.temp_c >= 85 else "")
    if gpu.power_w is not None:
        title.append(f"  {gpu.power_w:.0f} W")
        if gpu.power_limit_w:
            title.append(f"/{gpu.power_limit_w:.0f}", style="dim")
    return title


def pcie_text(gpu: GpuInfo) -> Text:
    """`PCIe to GPU 1.2 GiB/s  from GPU 40 MiB/s` (NVML's sample); empty where NVML has no counters."""
    if gpu.pcie_to_mib_s is None or gpu.pcie_from_mib_s is None:
        return Text()
    return Text.assemble(("PCIe ", "bold"), f"to GPU {mib(gpu.pcie_to_mib_s)}/s  from GPU {mib(gpu.pcie_from_mib_s)}/s")
