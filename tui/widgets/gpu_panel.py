"""The GPUs panel: one GpuCard per card, or a clear "no GPU" state with the host's CPU and RAM."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

from server.metrics_schema import MetricsSnapshot
from tui.format import mib
from tui.view import History
from tui.widgets.gpu_card import GpuCard
from tui.widgets.panel import Panel
from tui.widgets.quiet import update_text


class GpuPanel(Panel):
    DEFAULT_CSS = """
    GpuPanel #gpu-cards { height: auto; }
    GpuPanel #gpu-none { height: auto; }
    GpuPanel #gpu-host { height: auto; color: $text-muted; }
    """

    def __init__(self, *, id: str | None = "gpus") -> None:
        super().__init__("GPUs", "3", id=id)
        self._cards: list[GpuCard] = []

    def compose(self) -> ComposeResult:
        yield Vertical(id="gpu-cards")
        yield Static("", id="gpu-none")
        yield Static("", id="gpu-host")

    def show(self, snapshot: MetricsSnapshot, history: History) -> None:
        if len(self._cards) != len(snapshot.devices):  # its own list: cards just mounted are not in the DOM yet
            cards = self.query_one("#gpu-cards", Vertical)
            cards.remove_children()
            self._cards = [GpuCard() for _ in snapshot.devices]
            if self._cards:
                cards.mount_all(self._cards)
        for card, gpu in zip(self._cards, snapshot.devices, strict=True):
            if card.is_mounted:
                card.show(gpu)
            else:
                card.call_after_refresh(card.show, gpu)
        none = self.query_one("#gpu-none", Static)
        none.display = not snapshot.devices
        if not snapshot.devices:
            update_text(none, Text.assemble(("No GPU", "bold yellow"), ": the engine runs on the CPU.", style=""))
            self.set_title("GPUs: none")
        else:
            self.set_title(f"GPUs ({len(snapshot.devices)})")
        host = snapshot.host
        line = Text()
        line.append("host ", style="dim")
        line.append(f"CPU {host.cpu_pct:.0f}%")
        if host.cpu_count:
            line.append(f" of {host.cpu_count}", style="dim")
        if host.ram_total_mib:
            line.append(f"  RAM {mib(host.ram_used_mib)} / {mib(host.ram_total_mib)}")
        if host.engine_rss_mib is not None:
            line.append(f"  engine {mib(host.engine_rss_mib)}")
        update_text(self.query_one("#gpu-host", Static), line)
