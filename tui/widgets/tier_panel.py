"""Expert tier: share of routed experts served from VRAM / over PCIe / on the CPU and the cache's hit
rate, over the last window between two engine reports when the server sends the totals (else since
the engine started), the hit rate's sparkline (or "every expert resident" when the engine's tier mode
says there is no cache), swaps, adapt rounds and adapt wait over the last window and since start,
the hottest experts; clear states for a dense model and for no data yet."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import Static

from server.metrics_schema import HotExpert, MetricsSnapshot, TierView
from tui.format import count, pct, spark
from tui.view import History, TierWindow, has_tier_data, is_dense
from tui.widgets.panel import Panel
from tui.widgets.quiet import update_text
from tui.widgets.segment_bar import Segment, SegmentBar

TIER_STYLES = (("VRAM", "green3"), ("PCIe", "gold3"), ("CPU", "orange_red1"))
HIT_SPARK = 20  # polls the hit-rate sparkline shows


class TierPanel(Panel):
    DEFAULT_CSS = """
    TierPanel #tier-state { height: auto; }
    TierPanel #tier-legend { height: 1; }
    TierPanel #tier-lines { height: auto; }
    """

    def __init__(self, *, id: str | None = "tier") -> None:
        super().__init__("Expert tier", "4", id=id)

    def compose(self) -> ComposeResult:
        yield Static("", id="tier-state")
        yield SegmentBar(empty="", id="tier-bar")
        yield Static("", id="tier-legend")
        yield Static("", id="tier-lines")

    def _show_parts(self, on: bool) -> None:
        for wid in ("#tier-bar", "#tier-legend", "#tier-lines"):
            self.query_one(wid).display = on

    def show(self, snapshot: MetricsSnapshot, history: History) -> None:
        state = self.query_one("#tier-state", Static)
        if is_dense(snapshot):
            update_text(state, Text.assemble(("dense model", "bold"), ": no routed experts, nothing to tier."))
            state.display = True
            self._show_parts(False)
            return
        if not has_tier_data(snapshot):
            update_text(state, Text.assemble(("no tier data yet", "bold"),
                                       ": figures appear after the first decoding windows."))
            state.display = True
            self._show_parts(False)
            return
        tier = snapshot.tier
        assert tier is not None
        state.display = False
        self._show_parts(True)
        window = history.tier_window
        shares = ((window.vram_share, window.pcie_share, window.cpu_share) if window is not None
                  else (tier.vram_share, tier.pcie_share, tier.cpu_share))
        self.query_one(SegmentBar).segments = tuple(
            Segment(label, value, style) for (label, style), value in zip(TIER_STYLES, shares, strict=True)
        )
        legend = Text()
        for (label, style), value in zip(TIER_STYLES, shares, strict=True):
            legend.append("■ ", style=style)
            legend.append(f"{label} {pct(value, 1)}  ")
        update_text(self.query_one("#tier-legend", Static), legend)
        update_text(self.query_one("#tier-lines", Static), tier_lines(snapshot, history))


def tier_lines(snapshot: MetricsSnapshot, history: History) -> Text:
    """The lines under the share bar: the cache (or "every expert resident" when the tier mode says
    so), its hit-rate trend, swaps, adapt rounds and wait, the hottest experts, the window time."""
    tier = snapshot.tier
    assert tier is not None
    lines = Text()
    if tier.mode == "resident":  # no cache: a hit rate would only say where the experts live
        lines.append("every expert resident", style="bold")
        lines.append(" (no cache)", style="dim")
    else:
        window = history.tier_window
        lines.append("hit rate ", style="dim")
        if window is not None:  # the bar above and this rate: the last window; the engine's total beside
            lines.append(pct(window.vram_share, 1), style="bold")
            lines.append(f" last {window.seconds:.0f} s ({count(window.lookups)} lookups), ", style="dim")
            lines.append(pct(tier.hit_rate, 1))
            lines.append(" since start", style="dim")
        else:
            lines.append(pct(tier.hit_rate, 1), style="bold")
        if tier.experts_cached is not None and tier.experts_total:
            lines.append("  cached ", style="dim")
            lines.append(f"{count(tier.experts_cached)}/{count(tier.experts_total)}")
        if tier.mode == "simulated":
            lines.append("  simulated (no GPU)", style="dim")
        if len(history.hit_rate) > 1:  # per window, or since start from a server that sends no totals
            lines.append("\nhit rate trend ", style="dim")
            lines.append(spark(history.hit_rate, HIT_SPARK, top=1.0), style="green3")
            lines.append(" (per window)" if history.tier_window is not None else " (since start)", style="dim")
    if tier.mode != "resident":  # without a cache nothing is swapped or ranked
        lines.append("\n")
        lines.append_text(adapt_text(tier, history.tier_window))
        if tier.hot:
            lines.append("\n")
            lines.append_text(hot_text(tier.hot))
    if snapshot.stats is not None and snapshot.stats.ms_per_window is not None:
        lines.append("\nwindow ", style="dim")
        lines.append(f"{snapshot.stats.ms_per_window:.1f} ms")
        if snapshot.stats.rows_per_window is not None:
            lines.append(f"  {snapshot.stats.rows_per_window:.1f} rows", style="")
    return lines


def adapt_text(tier: TierView, window: TierWindow | None) -> Text:
    """Swaps, adapt rounds and adapt wait in the last window between two engine reports, then since
    start (the wait as its mean per decode window); since start only without a window."""
    text = Text()
    if window is not None:
        text.append(f"last {window.seconds:.0f} s: ", style="dim")
        text.append("swaps ", style="dim")
        text.append(count(window.swaps), style="bold")
        text.append("  adapt rounds ", style="dim")
        text.append(count(window.adapt_rounds), style="bold")
        if window.adapt_wait_ms is not None:
            text.append("  adapt wait ", style="dim")
            text.append(f"{window.adapt_wait_ms:.1f} ms", style="bold")
        text.append("\n")
    text.append("since start: ", style="dim")
    text.append(f"swaps {count(tier.swaps)}  rounds {count(tier.adapt_rounds)}  wait {tier.adapt_wait_ms:.1f} ms/window")
    return text


def hot_text(hot: list[HotExpert]) -> Text:
    """The hottest experts as layer/expert and their share of the layer's recent routing, one not in
    the cache marked "miss" (each time it is routed, it is served from host memory)."""
    text = Text()
    text.append("hottest (layer/expert, share of its layer's routing)\n", style="dim")
    for i, h in enumerate(hot):
        text.append("  " if i else "")
        text.append(f"L{h.layer}/E{h.expert} {pct(h.share)}")
        if not h.cached:
            text.append(" miss", style="orange_red1")
    return text
