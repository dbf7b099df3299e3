"""Quitting a dashboard that manages a server: stop it, or leave it running for `attach`."""

from __future__ import annotations

from rich.markup import escape
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static

QuitChoice = str  # "stop" | "leave"


class QuitScreen(ModalScreen[str | None]):
    BINDINGS = [
        Binding("s", "choose('stop')", "Stop the server"),
        Binding("l", "choose('leave')", "Leave it running"),
        Binding("escape,c", "choose(None)", "Cancel"),
    ]

    def __init__(self, url: str, inflight: int = 0) -> None:
        super().__init__(id="quit")
        self.url = url
        self.inflight = inflight

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static("Quit strata-desk", classes="dialog-title")
            text = (f"The server at {self.url} is still running.\n"
                    "Stop it (and its engine), or leave it running for clients? "
                    "`strata-desk attach` finds a server left running, `strata-desk stop` stops it.")
            if self.inflight:
                text += f"\n\n{self.inflight} request(s) are in flight: stopping ends them with an error."
            yield Static(text, classes="dialog-body")
            with Horizontal(classes="dialog-buttons"):
                yield Button(escape("Stop the server [s]"), id="stop", variant="error")
                yield Button(escape("Leave it running [l]"), id="leave", variant="primary")
                yield Button(escape("Cancel [esc]"), id="cancel")

    def on_mount(self) -> None:
        self.query_one("#leave", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(None if event.button.id == "cancel" else event.button.id)

    def action_choose(self, choice: str | None) -> None:
        self.dismiss(choice)
