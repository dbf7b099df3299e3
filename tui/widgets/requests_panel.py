"""Recent finished requests: tokens, times, tok/s, finish. "ago" counts from the request's end."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import DataTable

from server.metrics_schema import MetricsSnapshot, RequestRow
from tui.format import count, duration, rate
from tui.view import History
from tui.widgets.panel import Panel

FINISH_STYLE = {"stop": "green", "length": "yellow", "cancel": "grey50", "disconnect": "grey50",
                "error": "bold red"}
COLUMNS = ("ago", "prompt", "reused", "out", "ttft", "time", "tok/s", "path", "finish")


def request_cells(row: RequestRow, now: float) -> list[Text]:
    return [
        Text(duration(now - row.time - row.duration_s), justify="right"),  # row.time is its arrival
        Text(count(row.prompt_tokens), justify="right"),
        Text(count(row.reused), justify="right", style="dim"),
        Text(count(row.output_tokens), justify="right"),
        Text(duration(row.ttft_s) if row.ttft_s is not None else "-", justify="right"),
        Text(duration(row.duration_s), justify="right"),
        Text(rate(row.decode_tok_s), justify="right"),
        Text(row.path + (f" {row.slot}" if row.slot is not None and "slot" in row.path else "")),
        Text(row.finish, style=FINISH_STYLE.get(row.finish, "")),
    ]


class RequestsPanel(Panel):
    DEFAULT_CSS = """
    RequestsPanel DataTable { height: auto; max-height: 100%; background: transparent; }
    """

    def __init__(self, *, id: str | None = "requests") -> None:
        super().__init__("Recent requests", "5", id=id)

    def compose(self) -> ComposeResult:
        table: DataTable[Text] = DataTable(cursor_type="row", zebra_stripes=True)
        self._ago = table.add_columns(*COLUMNS)[0]
        self._ids: list[str] = []
        yield table

    def show(self, snapshot: MetricsSnapshot, history: History) -> None:
        table = self.query_one(DataTable)
        rows = snapshot.requests[:50]
        ids = [row.id for row in rows]
        if ids == self._ids:  # same requests: only the ages move; the cursor and scroll stay put
            for row in rows:
                table.update_cell(row.id, self._ago, request_cells(row, snapshot.time)[0], update_width=True)
        else:
            cursor = table.cursor_row
            table.clear()
            for row in rows:
                table.add_row(*request_cells(row, snapshot.time), key=row.id)
            if rows:
                table.move_cursor(row=min(cursor, len(rows) - 1), animate=False)
            self._ids = ids
        t = snapshot.totals
        self.set_title(f"Recent requests ({t.requests} total)")
        tail = f"{count(t.output_tokens)} tokens out, {count(t.prompt_tokens)} in"
        if t.errors:
            tail += f", {t.errors} errors"
        self.set_subtitle(tail)
