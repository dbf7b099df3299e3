"""One row per batch slot (idle / reading / decoding), or the solo path when parallel is 1."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import DataTable, Static

from server.metrics_schema import LiveView, MetricsSnapshot, ParkingView
from tui.format import count, duration, mib, rate, spark
from tui.view import History, solo_active, solo_tok_s
from tui.widgets.panel import Panel
from tui.widgets.quiet import update_text

STATE_STYLE = {"idle": "grey50", "reading": "bold yellow", "decoding": "bold green"}
COLUMNS = ("slot", "state", "tokens", "gen", "tok/s", "history", "elapsed")


class SlotsPanel(Panel):
    DEFAULT_CSS = """
    SlotsPanel DataTable { height: auto; max-height: 12; background: transparent; }
    SlotsPanel #slots-note { color: $text-muted; height: auto; }
    """

    def __init__(self, *, id: str | None = "slots") -> None:
        super().__init__("Slots", "1", id=id)
        self._shown: list[list[Text | str]] = []

    def compose(self) -> ComposeResult:
        table: DataTable[Text | str] = DataTable(cursor_type="none", zebra_stripes=False, show_cursor=False)
        table.add_columns(*COLUMNS)
        yield table
        yield Static("", id="slots-note")

    def _row(self, name: str, state: str, tokens: str, gen: str, tok_s: float | None, hist: str,
             elapsed: str) -> list[Text | str]:
        return [
            Text(name, style="bold"),
            Text(state, style=STATE_STYLE.get(state, "")),
            Text(tokens, justify="right"),
            Text(gen, justify="right"),
            Text(rate(tok_s) if tok_s else "-", justify="right"),
            Text(hist, style="green"),
            Text(elapsed, justify="right"),
        ]

    def rows(self, live: LiveView, history: History) -> list[list[Text | str]]:
        rows: list[list[Text | str]] = []
        solo = solo_active(live)
        if live.parallel <= 1 or not live.slots or solo:
            if live.state == "reading":
                state, tokens = "reading", f"{count(live.prompt_read)}/{count(live.prompt_total)}"
            elif live.state == "generating":
                state, tokens = "decoding", count(live.prompt_total or None)
            else:
                state, tokens = "idle", "-"
            busy = state != "idle"
            rows.append(self._row(
                "solo", state, tokens,
                count(live.generated) if busy else "-",
                solo_tok_s(live) if busy else None,
                spark(history.slot("solo"), 12),
                duration(live.elapsed_s) if busy else "-",
            ))
        for s in live.slots:
            if s.state == "idle":
                tokens = f"held {count(s.held_tokens)}" if s.held_tokens else "-"
                rows.append(self._row(str(s.slot), "idle", tokens, "-", None, spark(history.slot(s.slot), 12), "-"))
            else:
                rows.append(self._row(
                    str(s.slot), s.state, count(s.prompt_tokens), count(s.generated),
                    s.tok_s if s.state == "decoding" else None,
                    spark(history.slot(s.slot), 12), duration(s.elapsed_s),
                ))
        return rows

    def show(self, snapshot: MetricsSnapshot, history: History) -> None:
        live = snapshot.live
        table = self.query_one(DataTable)
        rows = self.rows(live, history)
        if table.row_count != len(rows):
            table.clear()
            for i, row in enumerate(rows):
                table.add_row(*row, key=str(i))
        else:
            for i, (row, before) in enumerate(zip(rows, self._shown, strict=False)):
                for col, value, old in zip(table.columns, row, before, strict=True):
                    if value != old:  # each update re-measures the table
                        table.update_cell(str(i), col, value, update_width=True)
        self._shown = rows
        busy = sum(1 for s in live.slots if s.state != "idle")
        if snapshot.engine.state == "dead" or live.state == "dead":
            self.set_title("Slots: the engine stopped")
            note = ""
        elif snapshot.engine.state == "starting" or live.state == "loading":
            self.set_title("Slots: waiting for the engine")
            note = ""
        elif live.parallel <= 1:
            self.set_title("Slots: solo path (parallel 1)")
            note = "one request at a time; others wait in the queue"
        else:
            self.set_title(f"Slots {busy}/{live.parallel} busy")
            note = "a request alone runs on the solo path" if solo_active(live) else ""
        if live.waiting_for_slot:
            note = (note + "  " if note else "") + f"{live.waiting_for_slot} waiting for a slot"
        if parked := parking_note(snapshot.parking):
            note = (note + "  " if note else "") + parked
        update_text(self.query_one("#slots-note", Static), note)
        self.query_one("#slots-note", Static).display = bool(note)


def parking_note(parking: ParkingView | None) -> str:
    """The conversations parked in host RAM now and how many came back from there since start;
    empty while parking is off or has done nothing."""
    if parking is None or not (parking.parked or parking.restores):
        return ""
    note = f"{parking.parked} parked ({mib(parking.parked_mib)} host RAM)"
    if parking.restores:
        note += f", {count(parking.restores)} restored"
        if parking.restore_ms_mean:
            note += f" (mean {parking.restore_ms_mean:.0f} ms)"
    return note
