"""`?`: the keys, and what each panel shows."""

from __future__ import annotations

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

KEYS = [
    ("?", "this help"),
    ("q", "quit (ctrl+q and the palette's Quit too): asks whether to stop the server or leave it running"),
    ("c", "copy the URL to give clients (or click it)"),
    ("s", "settings: parallel, batch groups, expert tier ... then apply and restart"),
    ("r", "restart the server and the engine"),
    ("u", "after a failed start: restore the previous config (.bak) and restart"),
    ("l", "full-screen log (server + engine): / search, f follow"),
    ("b", "benchmark arms (concurrency x settings)"),
    ("1-6", "show/hide a panel: 1 slots 2 throughput 3 GPUs 4 expert tier 5 requests 6 log"),
    ("0", "show all panels"),
    ("x", "while draining before a restart: restart now"),
    ("tab", "move between panels and controls; the mouse works too"),
    ("ctrl+p", "command palette"),
]

PANELS = [
    ("Slots", "one row per batch slot: idle / reading (prompt) / decoding; tokens held or read, "
              "generated, tok/s with its recent history, time. With parallel 1 the solo path."),
    ("Throughput", "generated tok/s of all requests, the last 60 s, prefill rate, running and waiting."),
    ("GPUs", "each card's VRAM: weights, expert cache, slot sessions, KV, other and free; util, "
             "temperature, power."),
    ("Expert tier", "where routed experts were served: VRAM cache, over PCIe, on the CPU; hit rate, "
                    "swaps and adapt rounds of the adaptive tier."),
    ("Recent requests", "finished requests: prompt, reused, output tokens, first-token time, tok/s, finish."),
]


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark", "dismiss(None)", "Close")]

    def compose(self) -> ComposeResult:
        keys = Table.grid(padding=(0, 2))
        keys.add_column(style="bold cyan", no_wrap=True)
        keys.add_column()
        for key, what in KEYS:
            keys.add_row(key, what)
        panels = Table.grid(padding=(0, 2))
        panels.add_column(style="bold", no_wrap=True)
        panels.add_column()
        for name, what in PANELS:
            panels.add_row(name, what)
        with VerticalScroll(classes="dialog", id="help-body"):
            yield Static("strata-desk: keys", classes="dialog-title")
            yield Static(keys)
            yield Static("Panels", classes="dialog-title")
            yield Static(panels)
            yield Static("esc closes this help", classes="dialog-note")
