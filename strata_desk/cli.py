"""The `strata-desk` command: the dashboard, headless serving, setup, bench and installs.

Every command that fails on bad input prints one line `strata-desk: error: ...` and exits 2.
The heavy modules (the dashboard, the server, torch through engine.bench and engine.check, the test
model's writer, the demo) are imported inside the subcommand that needs them, so `ps` or `info` start
fast.
docs/cli.md documents every subcommand.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from server.config import MAX_SLOTS, ConfigError, RunConfig, load_config, save_config, validate_config
from strata_desk import paths

PROG = "strata-desk"
PASSTHROUGH = ("bench-engine", "check")  # engine.bench, engine.check: they parse their own arguments
DEMO_MODELS = ("gemma", "chat", "moe")
# What a demo's config gets when it is made. SmolLM2 135M at Q4_1 loops on greedy replies ("Say hello
# in English." -> a row of stars; transformers does the same on that file): llama.cpp's former default
# repeat penalty breaks the loop. The MoE demo is there to show slots at work, also where setup would
# pick one request at a time (a CPU).
DEMO_CONFIG: dict[str, dict[str, Any]] = {"chat": {"sampling": {"repeat_penalty": 1.1}}, "moe": {"parallel": 4}}


class CliError(Exception):
    """A problem with what the user asked for: one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise CliError(f"{message} (see {self.prog} --help)")


# -- configs ---------------------------------------------------------------------------------


def _model_path(text: str, where: str = "") -> Path:
    model = Path(text).expanduser()
    if not model.is_file():
        raise CliError(f"model file not found: {model}{where}")
    return model


def _gguf_model(text: str) -> Path:
    """A model file that exists and whose header reads as GGUF (what bench-engine and check load)."""
    from engine.gguf_file import GGUFError, GGUFFile

    model = _model_path(text)
    try:
        GGUFFile(model)
    except GGUFError as exc:
        raise CliError(str(exc)) from None
    return model


def _demo_model(name: str) -> Path:
    if name == "chat":
        from strata_desk.demo import chat_model_path as path_of
    elif name == "moe":
        from strata_desk.demo import moe_model_path as path_of
    else:
        from strata_desk.demo import demo_model_path as path_of
    try:
        return Path(path_of())
    except (RuntimeError, OSError, ValueError) as exc:  # DemoModelMissing, a bad assembly
        raise CliError(str(exc)) from None


def update_config(config_path: Path, *, model: Path | None = None, parallel: int | None = None,
                  say: Callable[[str], Any] = print) -> None:
    """Point the config at `model` and/or set `parallel`, saving only when it changes."""
    config = load_config(config_path)
    changes: dict[str, Any] = {}
    if model is not None and config.model != str(model.resolve()):
        changes["model"] = str(model.resolve())
    if parallel is not None:
        if parallel != config.parallel:
            changes["parallel"] = parallel
            if isinstance(config.batch_groups, int) and changes["parallel"] % config.batch_groups:
                changes["batch_groups"] = "auto"
    if changes:
        data = {**config.model_dump(mode="json", exclude_defaults=True), **changes}
        save_config(validate_config(data, str(config_path)), config_path)
        say(f"updated {config_path}: " + ", ".join(f"{k} = {v}" for k, v in changes.items()))


def ensure_config(model: Path, parallel: int | None = None, quiet: bool = False,
                  defaults: dict[str, Any] | None = None) -> Path:
    """The config for `model`: reused when it exists (with `parallel` applied), else made by setup,
    with `defaults` (config keys) where the user did not choose."""
    from strata_desk.setup import build_config, write_config

    say: Callable[[str], Any] = (lambda _text: None) if quiet else print
    target = paths.config_path_for(model)
    if target.is_file():
        update_config(target, model=model, parallel=parallel, say=say)
        paths.remember_last_config(target)
        return target
    defaults = dict(defaults or {})
    config, messages = build_config(model, parallel=parallel or defaults.pop("parallel", None))
    if defaults:
        config = validate_config({**defaults, **config.model_dump(mode="json", exclude_defaults=True)}, str(target))
    for line in messages:
        say(f"  {line}")
    path = write_config(config)
    say(f"wrote {path}")
    return path


def _chosen_model(args: argparse.Namespace) -> Path | None:
    chosen = [name for name in ("demo", "model", "config") if getattr(args, name, None)]
    if len(chosen) > 1:
        raise CliError("choose one of " + ", ".join(f"--{c}" for c in chosen))
    if getattr(args, "demo", None):
        return _demo_model(args.demo)
    if getattr(args, "model", None):
        return _model_path(args.model)
    return None


def _target_config(args: argparse.Namespace) -> tuple[Path | None, Path | None]:
    """(config, model) the arguments name, checked but not written: --config (it must load, and its
    model exist), the config of --model/--demo (the model), else the last used config."""
    model = _chosen_model(args)
    if model is not None:
        return paths.config_path_for(model), model
    path = Path(args.config).expanduser() if getattr(args, "config", None) else paths.last_config()
    if path is None:
        return None, None
    if not path.is_file():
        raise CliError(f"config file not found: {path}")
    config = load_config(path)  # validates; ConfigError names the key
    _model_path(config.model, f" (the model of {path})")
    return path, None


def _apply_config(target: Path, model: Path | None, parallel: int | None, demo: str | None = None) -> Path:
    """Make or update (--parallel) the config, once every check has passed."""
    if model is not None:
        return ensure_config(model, parallel, defaults=DEMO_CONFIG.get(demo or ""))
    update_config(target, parallel=parallel)
    return target


def _parallel(text: str) -> int:
    value = _positive(text)
    if value > MAX_SLOTS:
        raise argparse.ArgumentTypeError(f"must be 1..{MAX_SLOTS} (the engine runs at most {MAX_SLOTS} "
                                         f"slots), got {value}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _port(text: str) -> int:
    value = _positive(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 1..65535, got {value}")
    return value


# -- subcommands -----------------------------------------------------------------------------


def _run_dashboard(config: Path | None, **kwargs: Any) -> int:
    from tui.app import run_dashboard

    code = run_dashboard(config, **{k: v for k, v in kwargs.items() if v is not None})
    return int(code or 0)


def cmd_dashboard(args: argparse.Namespace) -> int:
    target, model = _target_config(args)
    config = _apply_config(target, model, args.parallel, args.demo) if target is not None else None
    if config is not None:  # None -> the dashboard shows its first-run screen
        paths.remember_last_config(config)
    return _run_dashboard(config, host=args.host, port=args.port)


def _server_main() -> Callable[[list[str]], int]:
    from server import main

    return main


def _check_can_serve(config_path: Path, config: RunConfig, args: argparse.Namespace) -> None:
    """Refuse, before anything is written, what would not serve: a server already running with this
    config, or the port taken."""
    from strata_desk import state
    from strata_desk.launcher import busy_port_message, port_in_use

    running = state.running_for(config_path)
    if running is not None:
        raise CliError(f"a server with this config is already running at {running.url} (pid {running.pid}): "
                       "open it with `strata-desk attach`, or stop it with `strata-desk stop`")
    host, port = args.host or config.host, args.port or config.port
    if port_in_use(host, port):
        raise CliError(busy_port_message(host, port))


def cmd_serve(args: argparse.Namespace) -> int:
    from server.urls import server_url
    from strata_desk import state
    from strata_desk.launcher import server_args

    target, model = _target_config(args)
    if target is None:
        raise CliError("no config: give --model X.gguf, --config FILE or --demo (or run strata-desk setup)")
    if target.is_file():
        _check_can_serve(target, load_config(target), args)
    config_path = _apply_config(target, model, args.parallel, args.demo)
    config = load_config(config_path)
    _check_can_serve(config_path, config, args)  # a config made just now has not been checked yet
    argv = server_args(config_path, args.host, args.port, args.api_key)
    server_main = _server_main()
    paths.remember_last_config(config_path)
    url = server_url(args.host or config.host, args.port or config.port)
    state.record(state.RunningServer(os.getpid(), url, str(Path(config_path).resolve()),
                                     create_time=state.process_create_time(os.getpid())))
    try:
        return int(server_main(argv) or 0)
    finally:
        state.forget(os.getpid())


def cmd_setup(args: argparse.Namespace) -> int:
    from strata_desk.setup import build_config, write_config

    model = _model_path(args.model)
    config, messages = build_config(model, parallel=args.parallel, context=args.context)
    for line in messages:
        print(f"  {line}")
    target = paths.config_path_for(model)
    print(f"config: {target}\n  model {config.model}\n  context {config.context}, parallel {config.parallel}")
    if not args.yes and sys.stdin.isatty():
        answer = input("Write it? [Y/n] ").strip().lower()
        if answer not in ("", "y", "yes"):
            print("nothing written")
            return 1
    path = write_config(config)
    print(f"wrote {path}\nnext: `strata-desk` (dashboard) or `strata-desk serve` (headless)")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from strata_desk.state import find_running

    print(f"config dir: {paths.config_dir()}")
    print(f"log dir:    {paths.log_dir()}")
    print(f"data dir:   {paths.data_dir()}")
    print(f"state dir:  {paths.state_dir()}")
    last = paths.last_config()
    print(f"last used:  {last or '-'}")
    configs = paths.list_configs()
    print(f"configs ({len(configs)}):")
    for path in configs:
        try:
            c = load_config(path)
            print(f"  {path.name}: {c.model} (port {c.port}, parallel {c.parallel}, context {c.context})")
        except ConfigError as exc:
            print(f"  {path.name}: invalid: {exc}")
    running = find_running()
    print(f"running servers ({len(running)}):")
    for server in running:
        print(f"  pid {server.pid}: {server.url} ({server.config or 'no config'})")
    return 0


def cmd_ps(args: argparse.Namespace) -> int:
    from strata_desk import ps
    from strata_desk.state import find_running

    servers = find_running()
    if not servers:
        print("no server started by strata-desk is running")
        return 0
    print("\n".join(ps.format_servers(servers)))
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from strata_desk import ps
    from strata_desk.state import find_running

    if args.name and args.all:
        raise CliError("give a NAME or --all, not both")
    chosen = ps.select(find_running(), args.name, args.all)
    if not chosen:
        print("no server started by strata-desk is running")
    for server in chosen:
        print(f"stopping {ps.server_name(server)} (pid {server.pid}, {server.url}) ...", flush=True)
        ps.stop(server)
        print(f"stopped {ps.server_name(server)}")
    return 0


def cmd_make_test_model(argv: Sequence[str]) -> int:
    parser = _Parser(prog=f"{PROG} make-test-model", description="write the tiny random MoE test model")
    from strata_desk.testmodel import add_arguments, main

    add_arguments(parser)
    return int(main(parser.parse_args(list(argv))) or 0)


def _option_value(argv: Sequence[str], option: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == option and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(option + "="):
            return arg.split("=", 1)[1]
    return None


def cmd_passthrough(name: str, argv: Sequence[str]) -> int:
    """engine.bench / engine.check with their own arguments; a missing or unreadable model is one line."""
    model = _option_value(argv, "--model")
    if model is not None:
        _gguf_model(model)
    if name == "bench-engine":
        from engine.bench import main
    else:
        from engine.check import main
    from engine.gguf_file import GGUFError

    try:
        return int(main(list(argv)) or 0)
    except GGUFError as exc:  # a header that reads but a model the engine cannot load
        raise CliError(str(exc)) from None


def cmd_bench(args: argparse.Namespace) -> int:
    from strata_desk.bench import command

    return command.main(args)


def cmd_attach(args: argparse.Namespace) -> int:
    import httpx

    from server.urls import base_url, server_url
    from strata_desk.state import find_running

    url, key = args.url, args.key
    config = None
    if url is None:
        running = find_running()
        if running:
            url = running[-1].url
            config = Path(running[-1].config) if running[-1].config else None
        elif (config := paths.last_config()) is not None:
            c = load_config(config)
            url = server_url(c.host, c.port)
        else:
            raise CliError("no running server known: give its URL (strata-desk attach http://HOST:PORT)")
    if key is None and config is not None and config.is_file():
        key = load_config(config).api_key
    url = base_url(url)
    try:
        httpx.get(url + "/health", timeout=3.0)
    except httpx.HTTPError as exc:
        raise CliError(f"no server answers at {url} ({type(exc).__name__})") from None
    return _run_dashboard(None, attach_url=url, api_key=key)


def cmd_install_desktop(args: argparse.Namespace) -> int:
    from strata_desk import desktop

    if args.uninstall:
        removed = desktop.uninstall_desktop()
        print("\n".join(f"removed {p}" for p in removed) or "nothing to remove")
        return 0
    for path in desktop.install_desktop(autostart=args.autostart):
        print(f"wrote {path}")
    return 0


def cmd_install_service(args: argparse.Namespace) -> int:
    from strata_desk import desktop

    if args.uninstall:
        print(f"first: systemctl --user disable --now {desktop.SERVICE_NAME}")
        removed = desktop.uninstall_service()
        print("\n".join(f"removed {p}" for p in removed) or "nothing to remove")
        return 0
    config = Path(args.config).expanduser() if args.config else paths.last_config()
    if config is None:
        raise CliError("no config: give --config FILE (or run strata-desk setup MODEL.gguf first)")
    if not config.is_file():
        raise CliError(f"config file not found: {config}")
    load_config(config)
    path = desktop.install_service(config)
    print(f"wrote {path}\nto run it now and at every login:")
    for line in desktop.service_commands():
        print(f"  {line}")
    return 0


# -- parser ----------------------------------------------------------------------------------


def _model_args(parser: argparse.ArgumentParser, config: bool) -> None:
    parser.add_argument("--demo", nargs="?", const="gemma", choices=list(DEMO_MODELS), metavar="gemma|chat|moe",
                        help="a demo model: gemma (the default: Gemma 3 270M, a base model), chat (SmolLM2 135M "
                        "Instruct, downloaded once) or moe (a generated MoE model: its text is meaningless)")
    parser.add_argument("--model", metavar="X.gguf", help="make or reuse the config for this model")
    if config:
        parser.add_argument("--config", metavar="FILE", help="a run config strata-<model>.json")
    parser.add_argument("--host", help="address to bind (overrides the config)")
    parser.add_argument("--port", type=_port, help="port (overrides the config)")
    parser.add_argument("--parallel", type=_parallel, metavar="N",
                        help=f"batch slots 1..{MAX_SLOTS}, written to the config")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Serve a local mixture-of-experts LLM to several users, "
                     "and watch it work. Without a command: the dashboard.")
    _model_args(parser, config=True)
    parser.set_defaults(func=cmd_dashboard)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("serve", help="run the server headless (systemd, a box in a cupboard)")
    _model_args(p, config=True)
    p.add_argument("--api-key", help="clients must send this key (required beyond loopback)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("setup", help="probe the machine and write the config for a model")
    p.add_argument("model", metavar="MODEL.gguf")
    p.add_argument("--parallel", type=_parallel, metavar="N", help=f"batch slots 1..{MAX_SLOTS} (kept as asked)")
    p.add_argument("--context", type=_positive, metavar="N", help="context length in tokens")
    p.add_argument("--yes", "-y", action="store_true", help="write without asking")
    p.set_defaults(func=cmd_setup)

    p = sub.add_parser("info", help="where configs, logs and data live; configs and running servers")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("ps", help="the servers started here that are running: name, pid, URL, uptime, config")
    p.set_defaults(func=cmd_ps)

    p = sub.add_parser("stop", help="stop a server left running (by the dashboard, serve or bench)")
    p.add_argument("name", nargs="?", metavar="NAME", help="as `strata-desk ps` shows it (or the pid); "
                   "default: the only one running")
    p.add_argument("--all", action="store_true", help="stop every server started here")
    p.set_defaults(func=cmd_stop)

    sub.add_parser("make-test-model", help="write the tiny random MoE test model", add_help=False)

    p = sub.add_parser("bench", help="concurrent-client benchmark (the seed's table), A/B arms")
    from strata_desk.bench.command import add_arguments

    add_arguments(p)
    p.set_defaults(func=cmd_bench)

    sub.add_parser("bench-engine", help="engine-level benchmark (arguments go to engine.bench)", add_help=False)
    sub.add_parser("check", help="check the engine against the reference (arguments go to engine.check)",
                   add_help=False)

    p = sub.add_parser("attach", help="open the dashboard on a running server")
    p.add_argument("url", nargs="?", metavar="URL", help="default: the last server started here")
    p.add_argument("--key", help="API key (default: the server's config)")
    p.set_defaults(func=cmd_attach)

    p = sub.add_parser("install-desktop", help="add strata-desk to the desktop's application menu")
    p.add_argument("--uninstall", action="store_true", help="remove what install-desktop wrote")
    p.add_argument("--autostart", action="store_true", help="also open it at login")
    p.set_defaults(func=cmd_install_desktop)

    p = sub.add_parser("install-service", help="write a systemd user unit for `strata-desk serve`")
    p.add_argument("--uninstall", action="store_true", help="remove the unit")
    p.add_argument("--config", metavar="FILE", help="default: the last used config")
    p.set_defaults(func=cmd_install_service)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from strata_desk.bench import BenchError
    from strata_desk.desktop import DesktopError
    from strata_desk.launcher import LaunchError
    from strata_desk.ps import StopError
    from strata_desk.setup import SetupError

    try:
        if argv and argv[0] in PASSTHROUGH:
            return cmd_passthrough(argv[0], argv[1:])
        if argv and argv[0] == "make-test-model":
            return cmd_make_test_model(argv[1:])
        args = build_parser().parse_args(argv)
        return args.func(args)
    except (CliError, ConfigError, SetupError, BenchError, DesktopError, StopError) as exc:
        print(f"{PROG}: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    except LaunchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `strata-desk info | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
