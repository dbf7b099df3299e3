"""Total tok/s in big digits (over the server's window, 10 s), a 60 s sparkline, prefill rate,
running and waiting, the mean rate per request."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import Digits, Static

from server.metrics_schema import MetricsSnapshot
from tui.format import rate, spark_rows
from tui.view import History
from tui.widgets.panel import Panel
from tui.widgets.quiet import update_text


class ThroughputPanel(Panel):
    DEFAULT_CSS = """
    ThroughputPanel Digits { width: auto; color: $success; }
    ThroughputPanel #tp-unit { color: $text-muted; height: 1; }
    ThroughputPanel #tp-spark { height: 2; color: $success; }
    ThroughputPanel #tp-lines { height: auto; }
    """

    def __init__(self, *, id: str | None = "throughput") -> None:
        super().__init__("Throughput", "2", id=id)
        self._history: History | None = None
        self.border_subtitle = "last 60 s"

    def compose(self) -> ComposeResult:
        yield Digits("0.0", id="tp-digits")
        yield Static("tok/s generated, all requests", id="tp-unit")
        yield Static("", id="tp-spark")
        yield Static("", id="tp-lines").with_tooltip(
            "per request: the mean decode rate of the requests running and the recent ones")

    def on_resize(self) -> None:
        if self._history is not None:  # the sparkline fills the width: drawn again for a new one
            self._draw_spark()

    def _draw_spark(self) -> None:
        assert self._history is not None
        spark = self.query_one("#tp-spark", Static)
        width = spark.content_size.width or 40
        series = list(self._history.total)
        update_text(spark, "\n".join(spark_rows(series, width, 2)))
        spark.tooltip = f"peak {rate(max(series) if series else 0)} tok/s over the last {len(series)} s"

    def show(self, snapshot: MetricsSnapshot, history: History) -> None:
        live = snapshot.live
        digits = self.query_one(Digits)
        if digits.value != rate(live.tok_s):  # an update repaints it even when the value is the same
            digits.update(rate(live.tok_s))
        update_text(self.query_one("#tp-unit", Static),
            f"tok/s generated, all requests, last {live.tok_s_window_s:g} s")
        self._history = history
        self._draw_spark()
        lines = Text()
        lines.append("prefill ", style="dim")
        reading = live.state == "reading" or any(s.state == "reading" for s in live.slots)
        lines.append(f"{rate(live.prefill_tok_s if reading else 0.0)} tok/s")
        lines.append(f"  (mean {rate(live.prefill_tok_s_mean)})\n", style="dim")
        lines.append("running ", style="dim")
        lines.append(str(live.running), style="bold")
        lines.append("  waiting ", style="dim")
        lines.append(str(live.queued), style="bold yellow" if live.queued else "bold")
        lines.append("\nper request ", style="dim")
        lines.append(f"{rate(live.tok_s_mean)} tok/s")
        lines.append(" (mean)", style="dim")
        update_text(self.query_one("#tp-lines", Static), lines)
