"""`b`: benchmark arms (concurrency levels x settings) through strata_desk.bench.run_bench; the
table fills as rounds finish; results are saved with the settings and the hardware."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import Button, DataTable, Footer, Input, Label, Static

if TYPE_CHECKING:
    from strata_desk.launcher import ServerProcess

ARMS_HINT = "parallel=1; parallel=2   (empty: the server as it runs)"
COLUMNS = ("arm", "setting", "concurrent", "total tok/s", "vs first", "per request", "first token med/last",
           "rounds", "errors")


def bench_out_path() -> Path:
    from strata_desk import paths

    return paths.data_dir() / "bench" / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"


def parse_arms(text: str) -> list[dict[str, Any]]:
    from strata_desk.bench import parse_arm

    return [parse_arm(part) for part in text.replace("\n", ";").split(";") if part.strip()]


@dataclass(frozen=True)
class BenchTarget:
    """The server to benchmark, as the app knows it when the bench screen is shown. `server` and
    `config_path` only for a server this dashboard manages: arms restart it with other settings."""

    url: str | None
    key: str | None = None
    server: ServerProcess | None = None
    config_path: Path | None = None

    @property
    def can_run_arms(self) -> bool:
        return self.server is not None and self.config_path is not None


class BenchScreen(Screen[None]):
    class Status(Message):
        """What a running benchmark is doing (None: it ended), for the dashboard's banner."""

        def __init__(self, text: str | None) -> None:
            super().__init__()
            self.text = text

    class ConfigRestored(Message):
        """A benchmark with arms ended and put the config file back: read it again."""

    BINDINGS = [
        Binding("escape", "back", "Back"),
        Binding("ctrl+s", "run", "Run"),
    ]

    target: reactive[BenchTarget] = reactive(BenchTarget(None), init=False)

    def __init__(self, target: BenchTarget) -> None:
        super().__init__(id="bench")
        self.set_reactive(BenchScreen.target, target)
        self.running = False
        self.rows: dict[tuple[int, int], str] = {}
        self.rounds = 3

    def compose(self) -> ComposeResult:
        yield Static("Benchmark", classes="screen-title")
        with Vertical(id="bench-form"):
            with Horizontal(classes="bench-line"):
                yield Label("concurrency", classes="bench-label")
                yield Input("1,2,4", id="bench-conc")
                yield Label("max tokens", classes="bench-label")
                yield Input("256", id="bench-tokens", type="integer")
                yield Label("rounds", classes="bench-label")
                yield Input("3", id="bench-rounds", type="integer")
                yield Label("prompt words", classes="bench-label")
                yield Input("800", id="bench-words", type="integer")
            with Horizontal(classes="bench-line"):
                yield Label("arms", classes="bench-label")
                yield Input(placeholder=ARMS_HINT, id="bench-arms")
                yield Button("Run [ctrl+s]", id="bench-run", variant="primary")
                yield Button("Stop", id="bench-stop", disabled=True)
            yield Static("", id="bench-status")
        table: DataTable[Text | str] = DataTable(id="bench-table", zebra_stripes=True, cursor_type="row")
        table.add_columns(*COLUMNS)
        yield table
        yield Footer()

    def on_mount(self) -> None:
        self.watch_target(self.target)
        self.query_one("#bench-conc", Input).focus()

    def watch_target(self, target: BenchTarget) -> None:
        arms = self.query_one("#bench-arms", Input)
        arms.disabled = not target.can_run_arms
        arms.placeholder = (ARMS_HINT if target.can_run_arms
                            else "arms restart the server: only for a server this dashboard manages")

    def status(self, text: str, style: str = "") -> None:
        self.query_one("#bench-status", Static).update(Text(text, style=style))

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "bench-run":
            self.action_run()
        elif event.button.id == "bench-stop":
            self.workers.cancel_group(self, "bench")
            self._finished("stopped")

    def action_back(self) -> None:
        if self.running:
            self.notify("the benchmark keeps running in the background; b shows it again")
        self.dismiss()

    def action_run(self) -> None:
        if self.running:
            return
        from strata_desk.bench import BenchError, BenchSpec, parse_concurrency

        target = self.target
        try:
            concurrency = parse_concurrency(self.query_one("#bench-conc", Input).value)
            arms_text = self.query_one("#bench-arms", Input).value
            arms = parse_arms(arms_text) if arms_text.strip() and target.can_run_arms else []
            max_tokens = int(self.query_one("#bench-tokens", Input).value or 256)
            self.rounds = int(self.query_one("#bench-rounds", Input).value or 3)
            words = int(self.query_one("#bench-words", Input).value or 800)
        except (BenchError, ValueError) as exc:
            self.status(str(exc), "bold red")
            return
        if not target.url:
            self.status("no server yet", "bold red")
            return
        spec = BenchSpec(
            url=target.url, concurrency=concurrency, max_tokens=max_tokens, rounds=self.rounds,
            prompt_words=words, key=target.key, arms=arms, config=target.config_path if arms else None,
            out=bench_out_path(),
        )
        table = self.query_one(DataTable)
        table.clear()
        self.rows.clear()
        self.running = True
        self.query_one("#bench-run", Button).disabled = True
        self.query_one("#bench-stop", Button).disabled = False
        self.status("running ...", "italic")
        self.run_bench(spec, target.server if arms else None)

    @work(group="bench", exclusive=True, exit_on_error=False)
    async def run_bench(self, spec: Any, server: ServerProcess | None) -> None:
        from strata_desk.bench import run_bench

        try:
            result = await run_bench(spec, self.on_row, server=server, on_status=self.on_status)
        except Exception as exc:  # noqa: BLE001 - BenchError, ConfigError, LaunchError, HTTP errors
            self._finished(f"failed: {exc}", "bold red")
            return
        finally:
            if spec.arms:
                self.app.post_message(self.ConfigRestored())
        self._finished(f"done: {len(result.rows)} rows, saved to {spec.out} (with the settings and hardware)",
                       "bold green")

    def _finished(self, text: str, style: str = "") -> None:
        self.running = False
        self.app.post_message(self.Status(None))
        if self.is_mounted:
            self.query_one("#bench-run", Button).disabled = False
            self.query_one("#bench-stop", Button).disabled = True
            self.status(text, style)

    def on_status(self, text: str) -> None:
        self.app.post_message(self.Status(text))
        if self.is_mounted:
            self.status(text, "italic")

    def on_row(self, row: Any) -> None:
        self.app.post_message(self.Status(f"{row.setting}, {row.concurrency} concurrent: {row.total_tok_s:.1f} tok/s"))
        if not self.is_mounted:
            return
        vs = "-" if row.versus_first is None else f"{(row.versus_first.ratio - 1) * 100:+.0f}%"
        errors = Text(str(row.errors), style="bold red" if row.errors else "dim")
        cells: list[Text | str] = [
            str(row.arm + 1), row.setting, str(row.concurrency), f"{row.total_tok_s:.1f}", vs,
            f"{row.per_request_tok_s:.1f}", row.first_token_text,
            f"{len(row.rounds)}/{self.rounds}", errors,
        ]
        table = self.query_one(DataTable)
        key = (row.arm, row.concurrency)
        if key not in self.rows:
            self.rows[key] = f"{row.arm}-{row.concurrency}"
            table.add_row(*cells, key=self.rows[key])
        else:
            for col, value in zip(table.columns, cells, strict=True):
                table.update_cell(self.rows[key], col, value, update_width=True)
