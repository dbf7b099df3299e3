"""The main screen: header, slots, throughput, GPUs, expert tier, recent requests and the log."""

from __future__ import annotations

from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer

from server.metrics_schema import MetricsSnapshot
from tui.logs import LogBuffer
from tui.view import History
from tui.widgets.banner import Banner
from tui.widgets.gpu_panel import GpuPanel
from tui.widgets.header_bar import HeaderBar, HeaderInfo, UrlLabel
from tui.widgets.log_panel import LogPanel
from tui.widgets.panel import Panel
from tui.widgets.requests_panel import RequestsPanel
from tui.widgets.slots_panel import SlotsPanel
from tui.widgets.throughput_panel import ThroughputPanel
from tui.widgets.tier_panel import TierPanel

PANEL_KEYS = {"1": "slots", "2": "throughput", "3": "gpus", "4": "tier", "5": "requests", "6": "logs"}
WIDE = 118  # columns from which panels sit side by side


class DashboardScreen(Screen[None]):
    """Draws what the app hands it (`show_header`, `show_banner`, `show_metrics`, `show_logs`)."""

    class Shown(Message):
        """The dashboard was mounted or shown again: it wants the current view."""

    BINDINGS = [
        *[Binding(k, f"toggle_panel('{v}')", f"{v}", show=False) for k, v in PANEL_KEYS.items()],
        Binding("0", "show_all", "all panels", show=False),
    ]

    def __init__(self, buffer: LogBuffer) -> None:
        super().__init__(id="dashboard")
        self.buffer = buffer

    def compose(self) -> ComposeResult:
        yield HeaderBar()
        yield Banner(id="banner")
        with VerticalScroll(id="body"):
            with Horizontal(id="row-live", classes="row"):
                yield SlotsPanel()
                yield ThroughputPanel()
            with Horizontal(id="row-hw", classes="row"):
                yield GpuPanel()
                yield TierPanel()
            with Horizontal(id="row-log", classes="row"):
                yield RequestsPanel()
                yield LogPanel(self.buffer)
        yield Footer()

    def on_mount(self) -> None:
        self._layout(self.size.width)
        self.call_after_refresh(self.post_message, self.Shown())

    def on_screen_resume(self) -> None:
        self.call_after_refresh(self.post_message, self.Shown())

    def on_resize(self, event: events.Resize) -> None:
        self._layout(event.size.width)

    def _layout(self, width: int) -> None:
        self.set_class(width < WIDE, "-narrow")

    def panels(self) -> list[Panel]:
        return list(self.query(Panel))

    def show_header(self, info: HeaderInfo) -> None:
        self.query_one(HeaderBar).show(info)

    def show_banner(self, level: str | None, message: str = "", detail: str = "", keys: str = "") -> None:
        self.query_one(Banner).say(level, message, detail, keys)

    def show_metrics(self, snapshot: MetricsSnapshot, history: History) -> None:
        for panel in self.panels():
            panel.show(snapshot, history)

    def show_logs(self) -> None:
        self.query_one(LogPanel).show(None, History())

    def action_toggle_panel(self, panel_id: str) -> None:
        panel = self.query_one(f"#{panel_id}", Panel)
        panel.display = not panel.display
        for row in self.query(".row"):
            row.display = any(child.display for child in row.children)
        self.notify(f"{panel.base_title}: {'shown' if panel.display else 'hidden'} (0 shows all)", timeout=2)

    def action_show_all(self) -> None:
        for panel in self.panels():
            panel.display = True
        for row in self.query(".row"):
            row.display = True

    async def on_url_label_clicked(self, _: UrlLabel.Clicked) -> None:
        await self.app.run_action("copy_url")
