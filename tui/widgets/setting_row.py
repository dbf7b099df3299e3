"""One option of the settings form: name, control, one-line description, live error or note."""

from __future__ import annotations

from typing import Literal

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Input, Label, Static, Switch

# auto_int: auto or a whole number; cache: that or empty (None); text: as typed, for RunConfig to check
Kind = Literal["int", "float", "bool", "auto_int", "cache", "text"]


class SettingRow(Vertical):
    DEFAULT_CSS = """
    SettingRow { height: auto; padding: 0 1; margin-bottom: 1; }
    SettingRow > Horizontal { height: auto; }
    SettingRow .setting-name { width: 25; text-style: bold; }
    SettingRow Input { width: 12; }
    SettingRow Switch { width: 12; height: 1; border: none; padding: 0; }
    SettingRow .setting-desc { width: 1fr; padding: 0 0 0 2; color: $text-muted; }
    SettingRow .setting-msg { height: auto; padding: 0 0 0 26; display: none; }
    SettingRow.-error .setting-msg { display: block; color: $error; }
    SettingRow.-note .setting-msg { display: block; color: $warning; }
    SettingRow.-changed .setting-name { color: $accent; }
    SettingRow.-unsupported .setting-name { color: $text-disabled; }
    """

    def __init__(self, name: str, kind: Kind, value: object, description: str) -> None:
        super().__init__(id=f"set-{name}")
        self.key = name
        self.kind = kind
        self.initial = value
        self.description = description

    def compose(self) -> ComposeResult:
        with Horizontal():
            yield Label(self.key.replace("_", "-"), classes="setting-name")
            if self.kind == "bool":
                yield Switch(value=bool(self.initial), id=f"in-{self.key}")
            else:
                yield Input(value=self._text(self.initial), id=f"in-{self.key}", compact=True)
            yield Static(self.description, classes="setting-desc")
        yield Static("", classes="setting-msg")

    @staticmethod
    def _text(value: object) -> str:
        if value is None:
            return ""
        if isinstance(value, float):
            return f"{value:g}"
        return str(value)

    @property
    def control(self) -> Input | Switch:
        return self.query_one(f"#in-{self.key}")  # type: ignore[return-value]

    def raw(self) -> str | bool:
        control = self.control
        return control.value if isinstance(control, Switch) else control.value.strip()

    def set_value(self, value: object) -> None:
        control = self.control
        if isinstance(control, Switch):
            control.value = bool(value)
        else:
            control.value = self._text(value)

    def parsed(self) -> object:
        """The typed value; ValueError with a user-facing message when it does not parse."""
        raw = self.raw()
        if self.kind == "bool":
            return bool(raw)
        text = str(raw)
        if self.kind == "text":
            return text.lower()
        if self.kind == "cache" and not text:
            return None
        if self.kind in ("auto_int", "cache"):
            if text.lower() == "auto":
                return "auto"
            try:
                return int(text)
            except ValueError:
                hint = "enter auto or a whole number" + (", or leave it empty" if self.kind == "cache" else "")
                raise ValueError(hint) from None
        if self.kind == "int":
            try:
                return int(text)
            except ValueError:
                raise ValueError("enter a whole number") from None
        try:
            return float(text)
        except ValueError:
            raise ValueError("enter a number") from None

    def show_message(self, error: str | None, note: str | None = None) -> None:
        msg = self.query_one(".setting-msg", Static)
        self.set_class(bool(error), "-error")
        self.set_class(not error and bool(note), "-note")
        msg.update(error or note or "")

    def set_supported(self, supported: bool) -> None:
        self.set_class(not supported, "-unsupported")
        if self.kind == "bool":
            self.control.disabled = not supported and not bool(self.initial)
