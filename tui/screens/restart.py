"""Confirm a restart (plain, or applying changed settings): the diff, and what happens to the
requests in flight: drain (wait for them, then restart) or now (they end with an error)."""

from __future__ import annotations

from rich.markup import escape
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, RadioButton, RadioSet, Static

from server.config import RunConfig
from tui.lifecycle import RestartMode

Diff = list[tuple[str, object, object]]


def config_diff(old: RunConfig | None, new: RunConfig) -> Diff:
    """(option, old value, new value) for each option `new` changes."""
    before = old.model_dump() if old is not None else {}
    return [(k, before.get(k), v) for k, v in new.model_dump().items() if before.get(k) != v]


def diff_text(diff: Diff) -> Text:
    text = Text()
    for key, old, new in diff:
        text.append(f"{key:<16}", style="bold")
        text.append(f"{old!s:>8}", style="red")
        text.append("  ->  ")
        text.append(f"{new!s}\n", style="green")
    return text


class RestartScreen(ModalScreen[RestartMode | None]):
    """Dismisses with "drain", "now" or None (cancelled)."""

    BINDINGS = [
        Binding("escape", "cancel", "Cancel"),
        Binding("enter", "confirm", "Restart", show=False),
    ]

    def __init__(self, *, diff: Diff | None = None, inflight: int = 0, config_path: str = "") -> None:
        super().__init__(id="restart")
        self.diff = diff or []
        self.inflight = inflight
        self.config_path = config_path

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            title = "Apply settings and restart" if self.diff else "Restart the server and the engine"
            yield Static(title, classes="dialog-title")
            if self.diff:
                yield Static(diff_text(self.diff), id="restart-diff", classes="dialog-body")
                yield Static(f"written to {self.config_path} (the old file is kept as .bak)",
                             classes="dialog-note")
            if self.inflight:
                yield Static(f"{self.inflight} request(s) are in flight or waiting:", classes="dialog-body")
                with RadioSet(id="restart-mode"):
                    yield RadioButton("Drain: wait for them to finish, then restart", value=True, id="drain")
                    yield RadioButton("Now: restart at once, they end with an error", id="now")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Apply and restart" if self.diff else "Restart", id="ok", variant="warning")
                yield Button(escape("Cancel [esc]"), id="cancel")

    def on_mount(self) -> None:
        self.query_one("#ok", Button).focus()

    def mode(self) -> RestartMode:
        if not self.inflight:
            return "now"
        radio = self.query_one(RadioSet)
        return "now" if radio.pressed_button is not None and radio.pressed_button.id == "now" else "drain"

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "ok":
            self.action_confirm()
        else:
            self.action_cancel()

    def action_confirm(self) -> None:
        self.dismiss(self.mode())

    def action_cancel(self) -> None:
        self.dismiss(None)
