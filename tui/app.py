"""The strata-desk dashboard: starts (or attaches to) the server through its `ServerLifecycle`
(tui/lifecycle.py), polls /metrics at 1 Hz in an async worker, and drives the screens; what the
header and banner say comes from tui/view.py. Entry point for the CLI: `run_dashboard`.
"""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from textual import work
from textual.app import App
from textual.binding import Binding

from server import urls
from server.config import ConfigError, RunConfig, load_config, save_config
from server.metrics_schema import MetricsSnapshot
from strata_desk.launcher import ServerProcess
from strata_desk.ps import config_name
from tui.client import MetricsClient, MetricsSource, PollError
from tui.lifecycle import Phase, RestartMode, ServerLifecycle, adoptable, for_config
from tui.logs import FileTail, LogBuffer
from tui.messages import SnapshotUpdated
from tui.screens.dashboard import DashboardScreen
from tui.screens.help import HelpScreen
from tui.screens.logs import LogsScreen
from tui.screens.quit import QuitScreen
from tui.screens.restart import RestartScreen
from tui.view import BannerText, DeskState, HeaderInfo, History, banner, header_info

if TYPE_CHECKING:
    from tui.screens.bench import BenchScreen  # imported when `b` first opens it

Mode = Literal["managed", "attached", "setup"]

HERE = Path(__file__).parent


def backup_path(config_path: Path) -> Path:
    return config_path.with_name(config_path.name + ".bak")


def lan_address() -> str | None:
    """This machine's address on its network (no packet is sent), or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect(("10.255.255.255", 1))
            address = sock.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address


class StrataDeskApp(App[int]):
    """The dashboard app. Tests inject `source` (fixed metrics) or run it against a real server."""

    TITLE = "strata-desk"
    CSS_PATH = [HERE / "app.tcss", HERE / "screens" / "forms.tcss"]
    ENABLE_COMMAND_PALETTE = True

    BINDINGS = [
        Binding("question_mark", "help", "Help"),
        Binding("q", "quit_desk", "Quit"),
        Binding("ctrl+q", "quit_desk", "Quit", show=False, priority=True),
        Binding("c", "copy_url", "Copy URL"),
        Binding("s", "settings", "Settings"),
        Binding("r", "restart", "Restart"),
        Binding("u", "restore_backup", "Restore .bak"),
        Binding("x", "restart_now", "Restart now", show=False),
        Binding("escape", "cancel_drain", "Cancel restart", show=False),
        Binding("l", "logs", "Log"),
        Binding("b", "bench", "Bench"),
    ]

    def __init__(
        self,
        *,
        config_path: Path | None = None,
        attach_url: str | None = None,
        api_key: str | None = None,
        first_run: bool = False,
        source: MetricsSource | None = None,
        server: ServerProcess | None = None,
        poll_interval: float = 1.0,
        start_timeout: float = 300.0,
        drain_timeout: float = 600.0,
    ) -> None:
        super().__init__()
        self.config_path: Path | None = Path(config_path).expanduser().resolve() if config_path else None
        self.api_key = api_key
        self.poll_interval = poll_interval
        self.source: MetricsSource | None = source
        self.base_url: str | None = urls.base_url(attach_url) if attach_url else None
        self.config: RunConfig | None = None
        self.snapshot: MetricsSnapshot | None = None
        self.poll_error: str | None = None
        self.last_poll: float = 0.0
        self.history = History()
        self.logbuf = LogBuffer()
        self.tails: dict[str, FileTail] = {}
        self.exit_choice: str | None = None
        self.bench_status: str | None = None  # what the bench screen says it is doing (BenchScreen.Status)
        self._allowed: tuple[bool | None, ...] = ()  # check_action's answers when the footer was drawn
        if server is not None:
            self.config_path = server.config_path
        phase: Phase
        if first_run and attach_url is None:
            self.mode: Mode = "setup"  # asked for the first-run screen (even with a config around)
            phase = "setup"
            self.config_path = None
        elif self.config_path is not None:
            self.mode = "managed"
            phase = "idle"
        elif attach_url:
            self.mode = "attached"
            phase = "attached"
            if server is None and source is None:
                server = adoptable(self.base_url or "")
                if server is not None:
                    self.config_path = server.config_path
        else:
            self.mode = "setup"
            phase = "setup"
        self.lifecycle = ServerLifecycle(self, phase, server=server, inflight=self.inflight,
                                         start_timeout=start_timeout, drain_timeout=drain_timeout)
        self.first_run = first_run or self.mode == "setup"
        if self.config_path is not None:
            try:
                self.config = load_config(self.config_path)
            except ConfigError as exc:
                self.lifecycle.failure = ("The config cannot be used", [str(exc)])
                self.lifecycle.phase = "failed"

    # -- what we can do --------------------------------------------------------------------------

    @property
    def server(self) -> ServerProcess | None:
        return self.lifecycle.server

    @property
    def phase(self) -> Phase:
        return self.lifecycle.phase

    @property
    def can_manage(self) -> bool:
        return self.server is not None and self.config_path is not None

    @property
    def url(self) -> str:
        """The URL to give clients: on a server listening on all interfaces, this machine's address
        on the network (others cannot use 127.0.0.1)."""
        if not self.base_url:
            return ""
        host = self.config.host if self.config is not None else None
        if self.mode != "attached" and host in ("0.0.0.0", "::"):
            address = lan_address()
            if address:
                return urls.api_url(urls.server_url(address, urls.host_port(self.base_url)[1]))
        return urls.api_url(self.base_url)

    def inflight(self) -> int:
        if self.snapshot is None or self.poll_error:
            return 0
        return self.snapshot.live.running + self.snapshot.live.queued

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if self.mode == "setup" and action not in ("help", "quit_desk", "command_palette"):
            return False  # the first-run screen: nothing to monitor yet
        if action in ("settings", "restart"):
            return self.can_manage  # hidden (not just greyed out) for a server we cannot manage
        if action == "restore_backup":
            return self.phase == "failed" and self.config_path is not None and backup_path(self.config_path).exists()
        if action in ("restart_now", "cancel_drain"):
            return self.phase == "draining"
        return True

    # -- start-up --------------------------------------------------------------------------------

    def on_mount(self) -> None:
        self.dashboard = DashboardScreen(self.logbuf)
        self.push_screen(self.dashboard)
        self.set_interval(self.poll_interval, self._tick_logs)
        if self.mode == "setup":
            from tui.screens.first_run import FirstRunScreen

            self.push_screen(FirstRunScreen(), self._first_run_done)
        elif self.mode == "managed":
            if self.lifecycle.server is None:
                assert self.config_path is not None
                self.lifecycle.server = for_config(self.config_path)
            server = self.lifecycle.server
            if self.phase == "failed":  # the config did not load: the banner says why, u / s / r help
                pass
            elif server.running:
                self._use_url(server.url)
                self.lifecycle.phase = "running"
            else:
                self.lifecycle.start()
        if self.base_url and self.source is None:
            self._use_url(self.base_url)
        if self.source is not None:
            self.poll()
        self.refresh_view()

    def _first_run_done(self, config_path: Path | None) -> None:
        if config_path is None:
            self.exit(0)
            return
        self.config_path = Path(config_path)
        self.config = load_config(self.config_path)
        self.mode = "managed"
        self.lifecycle.server = ServerProcess(self.config_path)
        self.lifecycle.start()

    def _use_url(self, base_url: str) -> None:
        self.base_url = urls.base_url(base_url)
        if self.source is None or isinstance(self.source, MetricsClient):
            if not (isinstance(self.source, MetricsClient) and self.source.base_url == self.base_url):
                old = self.source
                key = self.api_key or (self.config.api_key if self.config else None)
                self.source = MetricsClient(self.base_url, key)
                if old is not None:
                    self.run_worker(old.aclose(), exit_on_error=False)
                self.poll()
        if self.server is not None and "server" not in self.tails:
            self.tails["server"] = FileTail(self.server.log_path, "server")

    def on_server_lifecycle_changed(self, _: ServerLifecycle.Changed) -> None:
        self.refresh_view()

    def on_dashboard_screen_shown(self, _: DashboardScreen.Shown) -> None:
        self.refresh_view()

    def on_server_lifecycle_log(self, message: ServerLifecycle.Log) -> None:
        self.logbuf.add("desk", message.text)

    def on_server_lifecycle_started(self, message: ServerLifecycle.Started) -> None:
        self._use_url(message.url)

    def on_bench_screen_status(self, message: BenchScreen.Status) -> None:
        self.bench_status = message.text
        self.refresh_view()

    def on_bench_screen_config_restored(self, _: BenchScreen.ConfigRestored) -> None:
        self.reload_config()

    def on_server_lifecycle_stopped(self, _: ServerLifecycle.Stopped) -> None:
        self.exit(0)

    # -- polling ---------------------------------------------------------------------------------

    @work(group="poll", exclusive=True, exit_on_error=False)
    async def poll(self) -> None:
        """Fetch /metrics every `poll_interval` s; the await never blocks input."""
        while True:
            started = time.monotonic()
            source = self.source
            if source is not None:
                try:
                    snapshot = await source.fetch()
                except PollError as exc:
                    self.poll_error = str(exc)
                except Exception as exc:  # noqa: BLE001 - polling must outlive any surprise
                    self.poll_error = f"{type(exc).__name__}: {exc}"
                else:
                    self.poll_error = None
                    self._on_snapshot(snapshot)
                self.last_poll = time.monotonic()
                self.refresh_view()
            await asyncio.sleep(max(0.05, self.poll_interval - (time.monotonic() - started)))

    def _on_snapshot(self, snapshot: MetricsSnapshot) -> None:
        self.snapshot = snapshot
        self.history.push(snapshot)
        log_path = snapshot.engine.log_path
        if log_path and "engine" not in self.tails:
            server_log = self.tails.get("server")
            if server_log is None or Path(log_path) != server_log.path:
                self.tails["engine"] = FileTail(log_path, "engine")

    def _tick_logs(self) -> None:
        new = False
        for tail in list(self.tails.values()):
            for line in tail.read():
                self.logbuf.add(tail.source, line)
                new = True
        if new:
            for screen in self.screen_stack:
                if isinstance(screen, DashboardScreen) and screen.is_mounted and screen.is_running:
                    screen.show_logs()
                elif isinstance(screen, LogsScreen) and screen.is_mounted:
                    screen.refresh_logs()

    # -- drawing ---------------------------------------------------------------------------------

    def desk_state(self) -> DeskState:
        """The plain values the header and the banner are drawn from (tui/view.py)."""
        lc = self.lifecycle
        return DeskState(
            phase=lc.phase, mode=self.mode, snapshot=self.snapshot, poll_error=self.poll_error,
            base_url=self.base_url, url=self.url, served_name=self.config.served_name if self.config else "",
            progress=lc.progress, failure=lc.failure, inflight=self.inflight(), can_manage=self.can_manage,
            backup_exists=self.config_path is not None and backup_path(self.config_path).exists(),
            server_lines=tuple(line.text for line in self.logbuf.lines if line.source == "server")[-3:],
            bench_status=self.bench_status,
        )

    def header_info(self) -> HeaderInfo:
        return header_info(self.desk_state())

    def banner(self) -> BannerText:
        return banner(self.desk_state())

    def refresh_view(self) -> None:
        dash = getattr(self, "dashboard", None)
        if dash is None or not dash.is_mounted or not dash.is_running:  # not yet, or closing
            return
        desk = self.desk_state()
        dash.show_header(header_info(desk))
        dash.show_banner(*banner(desk))
        if self.snapshot is not None:
            dash.show_metrics(self.snapshot, self.history)
            # only to the screens above the dashboard: a message to Textual's default screen under it
            # repaints the whole dashboard
            stack = self.screen_stack
            for screen in stack[stack.index(dash) + 1:] if dash in stack else ():
                screen.post_message(SnapshotUpdated(self.snapshot, self.inflight()))
        allowed = tuple(self.check_action(name, ()) for name in ("settings", "restart", "restore_backup",
                                                                  "restart_now", "cancel_drain"))
        if allowed != self._allowed:  # the footer is rebuilt on every refresh_bindings: only on a change
            self._allowed = allowed
            self.refresh_bindings()

    # -- actions ---------------------------------------------------------------------------------

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_copy_url(self) -> None:
        if not self.url:
            self.notify("no URL yet", severity="warning")
            return
        self.copy_to_clipboard(self.url)
        self.notify(f"copied {self.url}", title="URL for clients", timeout=3)

    def action_logs(self) -> None:
        sources = ", ".join(str(t.path) for t in self.tails.values()) or "no log files yet"
        self.push_screen(LogsScreen(self.logbuf, sources))

    def action_settings(self) -> None:
        if not self.can_manage:
            self.notify("settings need a server this dashboard manages", severity="warning")
            return
        if self.config is None:
            self.notify("the config file does not load (see the banner); u restores the .bak", severity="error")
            return
        from tui.screens.settings import SettingsScreen

        def chosen(result: tuple[RunConfig, RestartMode] | None) -> None:
            if result is not None:
                self.apply_settings(*result)

        self.push_screen(SettingsScreen(self.config, self.config_path, self.snapshot, self.inflight()), chosen)

    def action_bench(self) -> None:
        """The bench screen is installed once, so a benchmark goes on while the dashboard shows."""
        from tui.screens.bench import BenchScreen, BenchTarget

        managed = self.can_manage  # arms restart the server: only one this dashboard manages
        target = BenchTarget(self.base_url, self.api_key or (self.config.api_key if self.config else None),
                             server=self.server if managed else None,
                             config_path=self.config_path if managed else None)
        if not self.is_screen_installed("bench"):
            self.install_screen(BenchScreen(target), name="bench")
        else:
            self.get_screen("bench", BenchScreen).target = target
        if self.screen.id != "bench":
            self.push_screen("bench")

    def action_restart(self) -> None:
        if not self.can_manage:
            return
        if self.phase in ("starting", "restarting", "draining"):
            self.notify("a start or restart is already under way", severity="warning")
            return

        def chosen(mode: RestartMode | None) -> None:
            if mode is not None:
                self.lifecycle.restart(mode)

        self.push_screen(RestartScreen(inflight=self.inflight()), chosen)

    def apply_settings(self, new: RunConfig, mode: RestartMode) -> None:
        """Write `new` (atomic, .bak kept) and restart with it; mode "drain" or "now"."""
        assert self.config_path is not None
        save_config(new, self.config_path)
        self.config = new
        self.logbuf.add("desk", f"settings written to {self.config_path}")
        self.lifecycle.restart(mode)

    def reload_config(self) -> None:
        if self.config_path is None:
            return
        try:
            self.config = load_config(self.config_path)
        except ConfigError as exc:
            self.notify(str(exc), severity="error", title="config")

    def action_restart_now(self) -> None:
        self.lifecycle.restart_now()

    def action_cancel_drain(self) -> None:
        self.lifecycle.cancel_drain()
        self.notify("restart cancelled (the settings file keeps any change you applied)")

    def action_restore_backup(self) -> None:
        if self.config_path is None:
            return
        bak = backup_path(self.config_path)
        try:
            previous = load_config(bak)
        except ConfigError as exc:
            self.notify(str(exc), severity="error", title="cannot restore the .bak")
            return
        save_config(previous, self.config_path)  # the failed config becomes the new .bak
        self.config = previous
        self.logbuf.add("desk", f"restored {bak.name} over {self.config_path.name}; restarting")
        self.notify("previous config restored; restarting", timeout=3)
        if self.lifecycle.server is None:
            self.lifecycle.server = ServerProcess(self.config_path)
        self.lifecycle.start(restart=self.lifecycle.server.running)

    async def action_quit(self) -> None:
        """Every way out (q, ctrl+q, the command palette's Quit) asks the same question."""
        self.action_quit_desk()

    def farewell(self) -> str | None:
        """What the terminal says once the dashboard has closed and left its server running."""
        if self.exit_choice != "leave" or self.server is None or self.config_path is None:
            return None
        name = config_name(self.config_path)
        return (f"strata-desk: the server ({name}) and its engine are still running at {self.url} "
                f"(pid {self.server.pid}).\n"
                f"  open it again: strata-desk attach    list: strata-desk ps    stop it: strata-desk stop {name}")

    def action_quit_desk(self) -> None:
        if self.server is not None and self.server.running and self.phase != "failed":
            def chosen(choice: str | None) -> None:
                if choice == "stop":
                    self.stop_and_exit()
                elif choice == "leave":
                    self.exit_choice = "leave"
                    self.exit(0)

            self.push_screen(QuitScreen(self.url, self.inflight()), chosen)
            return
        if self.server is not None and self.server.running:
            self.stop_and_exit()  # a failed server is not worth leaving behind
            return
        self.exit(0)

    def stop_and_exit(self) -> None:
        self.exit_choice = "stop"
        self.lifecycle.stop()

    async def on_unmount(self) -> None:
        if self.source is not None:
            await self.source.aclose()


def run_dashboard(
    config_path: Path | None = None,
    *,
    attach_url: str | None = None,
    api_key: str | None = None,
    first_run: bool = False,
    url: str | None = None,
    host: str | None = None,
    port: int | None = None,
) -> int:
    """Open the dashboard; returns the exit code.

    config_path: start (or find running) and manage that server; attach_url: monitor a server it did
    not start (settings and restart only when the state file says which config it runs); neither:
    the first-run screen. `url` is an alias of attach_url, and host/port override the config's
    listen address (both as the CLI passes them).
    """
    server = None
    if config_path is not None and (host or port):
        server = ServerProcess(Path(config_path), host=host, port=port)
    app = StrataDeskApp(config_path=config_path, attach_url=attach_url or url, api_key=api_key,
                        first_run=first_run, server=server)
    result = app.run()
    note = app.farewell()
    if note:
        print(note)
    return int(result or 0)
