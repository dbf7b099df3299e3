"""`s`: the engine and tier options, validated live by RunConfig itself, applied with a diff and a
restart (drain or now). Options this engine does not run yet, and options that would have no effect as
the form stands (`tui.view.option_notes`), are shown as such."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError
from rich.markup import escape
from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.widgets import Button, Footer, Input, Static, Switch

from server.config import RunConfig
from server.metrics_schema import MetricsSnapshot
from tui.lifecycle import RestartMode
from tui.messages import SnapshotUpdated
from tui.screens.restart import RestartScreen, config_diff
from tui.view import OPTIONAL_OPTIONS, layer_split_note, option_notes, supported_options
from tui.widgets.setting_row import Kind, SettingRow

SETTINGS: list[tuple[str, Kind, str]] = [
    ("parallel", "int", "batch slots: up to N conversations decode together (1 = one at a time; 1-8)"),
    ("layer_split", "text", "layers across GPUs: the first layer of each later GPU (24 or 12,24,36), auto, "
                            "or empty (one device)"),
    ("batch_groups", "auto_int", "pipeline groups on a layer split: auto, or a number that divides parallel"),
    ("batch_mtp", "bool", "each batch slot verifies one MTP draft per window (needs --mtp)"),
    ("expert_cache", "cache", "expert tier: cache slots over all layers, or auto (what fits the free VRAM); "
                              "empty = every expert in memory"),
    ("adapt_every", "int", "re-rank the VRAM expert tier every N windows (0 = the tier stays fixed)"),
    ("adapt_swaps", "int", "most experts swapped into VRAM per re-rank"),
    ("adapt_decay", "float", "routing counts are multiplied by this after each re-rank (near 1 = long memory)"),
    ("adapt_async", "bool", "swap experts on a helper thread instead of holding a window up"),
    ("adapt_min_gain", "float", "a swap must gain this factor in routing count (higher = fewer swaps)"),
    ("adapt_min_count", "float", "routing count an uncached expert needs before it displaces a cached one"),
    ("pcie_frac", "float", "share of missed experts read over PCIe to the GPU instead of run on the CPU "
                           "(0-1; -1 = the engine measures and chooses)"),
    ("prefill_borrow", "bool", "prompt chunks borrow expert-cache slots for their buffers (off: the cache "
                               "leaves room for them)"),
    ("mmap_experts", "bool", "leave the routed experts in the file's memory map instead of pinned RAM (low RAM; "
                             "much slower; the engine does so itself when RAM is short)"),
    ("conversation_cache_mib", "int", "host RAM for conversations parked when their slot is taken, MiB (0 = off)"),
    ("conversation_cache_slots", "int", "most conversations parked (0 = off)"),
    ("cpu_activations", "text", "CPU decode products: int16 (the reference's replies), int8 (llama.cpp's "
                                  "rounding; faster only for matrices not packed) or float"),
    ("cuda_graphs", "bool", "replay each decode window from a CUDA graph: one launch instead of hundreds "
                            "(GPU; turn off to rule it out when something looks wrong)"),
    ("dense_copies", "bool", "keep the layers' dense matrices and a Q6_K head dequantized in the VRAM left free: "
                             "batches of 2-8 rows ~12% faster (GPU; none in exact mode)"),
    ("cpu_plans", "bool", "replay each CPU decode window from its plan: the step's kernel calls in one "
                          "(CPU, no expert cache; turn off to rule it out when something looks wrong)"),
    ("prefill", "auto_int", "prompt chunk in tokens, or auto (on a GPU the largest up to 8192 that fits the "
                            "VRAM left); the slots decode between a long prompt's chunks"),
    ("context", "int", "context length in tokens (each slot's KV grows with it)"),
]
UNSUPPORTED = "not supported by this engine yet"


def field_errors(err: ValidationError, names: list[str]) -> dict[str, str]:
    """RunConfig's errors by option; a whole-model error goes to the option its message names."""
    out: dict[str, str] = {}
    for e in err.errors():
        msg = str(e["msg"]).removeprefix("Value error, ")
        loc = [str(p) for p in e["loc"]]
        if loc:
            name = loc[0]
        else:  # the option named first in the message ("batch_groups (3) must divide parallel (4)")
            named = [(msg.find(n), n) for n in names if n in msg]
            name = min(named)[1] if named else names[0]
        out.setdefault(name, msg)
    return out


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


SettingsResult = tuple[RunConfig, RestartMode]  # what to write, and how to restart


class SettingsScreen(Screen[SettingsResult | None]):
    """Dismisses with the validated config and the restart mode chosen, or None (back)."""

    BINDINGS = [
        Binding("escape", "back", "Back"),
        Binding("ctrl+s", "apply", "Apply and restart"),
        Binding("ctrl+r", "revert", "Revert"),
    ]

    def __init__(self, config: RunConfig, config_path: Path | None, snapshot: MetricsSnapshot | None,
                 inflight: int = 0) -> None:
        super().__init__(id="settings")
        self.base: RunConfig = config
        self.config_path = config_path
        self.snapshot = snapshot
        self.inflight = inflight
        self.candidate: RunConfig | None = config
        self.errors: dict[str, str] = {}
        self.supported: set[str] = set()
        self._intro_done = False

    def compose(self) -> ComposeResult:
        yield Static("Settings", classes="screen-title")
        yield Static("", id="settings-intro")
        with VerticalScroll(id="settings-form"):
            for name, kind, desc in SETTINGS:
                yield SettingRow(name, kind, getattr(self.base, name), desc)
        with Horizontal(id="settings-buttons", classes="dialog-buttons"):
            yield Static("", id="settings-summary")
            yield Button("Apply and restart [ctrl+s]", id="apply", variant="warning", compact=True)
            yield Button("Revert [ctrl+r]", id="revert", compact=True)
            yield Button(escape("Back [esc]"), id="back", compact=True)
        yield Footer()

    def on_mount(self) -> None:
        if self.snapshot is not None:
            self._show_engine(self.snapshot)
        self.validate()
        self.query_one("#in-parallel").focus()

    def on_snapshot_updated(self, message: SnapshotUpdated) -> None:
        self.snapshot = message.snapshot
        self.inflight = message.inflight
        self._show_engine(message.snapshot)

    def _show_engine(self, snapshot: MetricsSnapshot) -> None:
        """The intro names what this engine runs; the rows say which options it does not."""
        supported = supported_options(snapshot.engine)
        if supported == self.supported and self._intro_done:
            return
        self.supported = supported
        self._intro_done = True
        engine = snapshot.engine.version or "engine"
        text = Text()
        text.append(f"{self.config_path}\n", style="bold")
        text.append("Changes apply after a restart of the server and the engine. ")
        text.append(f"{engine} runs: ")
        text.append(", ".join(sorted(supported)) or "none of batch-mtp, batch-groups > 1",
                    style="italic")
        self.query_one("#settings-intro", Static).update(text)
        self.validate()

    def rows(self) -> list[SettingRow]:
        return list(self.query(SettingRow))

    def row(self, name: str) -> SettingRow:
        return self.query_one(f"#set-{name}", SettingRow)

    def values(self) -> tuple[dict[str, Any], dict[str, str]]:
        data = self.base.model_dump()
        errors: dict[str, str] = {}
        for row in self.rows():
            try:
                data[row.key] = row.parsed()
            except ValueError as exc:
                errors[row.key] = str(exc)
        return data, errors

    def validate(self) -> RunConfig | None:
        """Parse every field and let RunConfig judge the whole; show each option's message."""
        data, errors = self.values()
        names = [n for n, _, _ in SETTINGS]
        candidate: RunConfig | None = None
        if not errors:
            try:
                candidate = RunConfig.model_validate(data)
            except ValidationError as err:
                errors.update(field_errors(err, names))
        notes: dict[str, str] = {}
        for option in OPTIONAL_OPTIONS:
            ok = option in self.supported
            row = self.row(option)
            row.set_supported(ok or option == "batch_groups")
            if ok:
                continue
            value = data.get(option)
            if option == "batch_groups":
                if isinstance(value, int) and value > 1 and option not in errors:
                    errors[option] = f"groups above 1 are {UNSUPPORTED}"
            elif value and value != getattr(self.base, option):
                errors[option] = UNSUPPORTED
            elif value:
                notes[option] = f"on in the config, but {UNSUPPORTED}: it runs without it"
            else:
                notes[option] = UNSUPPORTED
        notes.setdefault("batch_groups", self._groups_note(data))
        for option, note in option_notes(data, self.snapshot.engine if self.snapshot else None).items():
            notes.setdefault(option, note)
        for row in self.rows():
            row.show_message(errors.get(row.key), notes.get(row.key))
            row.set_class(row.key not in errors and data.get(row.key) != getattr(self.base, row.key), "-changed")
        self.errors = errors
        self.candidate = None if errors else candidate
        self._summary()
        return self.candidate

    def _groups_note(self, data: dict[str, Any]) -> str:
        parallel = data.get("parallel") if isinstance(data.get("parallel"), int) else self.base.parallel
        groups = data.get("batch_groups")
        split = data.get("layer_split") if isinstance(data.get("layer_split"), str) else None
        allowed = "auto or " + ", ".join(str(d) for d in divisors(max(1, parallel)))
        if parallel == 1:
            where = "parallel 1: no batch slots to group, one window at a time"
        elif not split:
            where = "no layer split (one GPU): groups only matter with a layer split"
        elif unsplit := layer_split_note(self.snapshot.engine if self.snapshot else None):
            where = f"layer split {split}: {unsplit}"
        else:
            stages = "one per GPU" if split == "auto" else len([p for p in split.split(",") if p.strip()]) + 1
            where = f"layer split {split}: {stages} stages"
            if isinstance(groups, int) and groups >= 1 and parallel % groups == 0:
                where += f", {parallel} slots in {groups} group(s) of {parallel // groups}"
            elif groups == "auto":
                where += ", auto: one group per stage"
        return f"{where}; allowed: {allowed}"

    def _summary(self) -> None:
        summary = self.query_one("#settings-summary", Static)
        if self.errors:
            summary.update(Text(f"{len(self.errors)} problem(s) to fix", style="bold red"))
        elif self.candidate is not None and self.candidate != self.base:
            summary.update(Text(f"{len(config_diff(self.base, self.candidate))} change(s)", style="bold"))
        else:
            summary.update(Text("no changes", style="dim"))
        self.query_one("#apply", Button).disabled = bool(self.errors)

    @on(Input.Changed)
    @on(Switch.Changed)
    def _changed(self, _: object) -> None:
        self.validate()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        match event.button.id:
            case "apply":
                self.action_apply()
            case "revert":
                self.action_revert()
            case "back":
                self.action_back()

    def action_revert(self) -> None:
        for row in self.rows():
            row.set_value(getattr(self.base, row.key))
        self.validate()

    def action_back(self) -> None:
        self.dismiss(None)

    def action_apply(self) -> None:
        new = self.validate()
        if new is None:
            self.notify("fix the marked options first", severity="error")
            return
        diff = config_diff(self.base, new)
        if not diff:
            self.notify("nothing changed")
            return

        def chosen(mode: RestartMode | None) -> None:
            if mode is not None:
                self.dismiss((new, mode))

        self.app.push_screen(
            RestartScreen(diff=diff, inflight=self.inflight, config_path=str(self.config_path)), chosen
        )
