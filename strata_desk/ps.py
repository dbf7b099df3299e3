"""`strata-desk ps` and `strata-desk stop`: the servers started on this machine, from the record
`strata_desk.state` keeps (the dashboard's, `serve`'s and bench's)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from strata_desk import state
from strata_desk.launcher import terminate_tree
from strata_desk.state import RunningServer
from tui.format import duration  # pure (no Textual): the same durations as the dashboard


class StopError(ValueError):
    """`stop` was asked for a server that is not running; nothing was stopped."""


def config_name(config_path: str | Path) -> str:
    """A config file's name without `strata-` and `.json` (`strata-tiny-moe.json` -> `tiny-moe`)."""
    return Path(config_path).stem.removeprefix("strata-")


def server_name(server: RunningServer) -> str:
    """The name `ps` shows and `stop` takes: its config's name, or the pid for a server recorded
    without a config."""
    return config_name(server.config) if server.config else str(server.pid)


def format_servers(servers: Sequence[RunningServer], now: float | None = None) -> list[str]:
    """The `ps` table: name, pid, URL, uptime, config."""
    now = time.time() if now is None else now
    rows = [("NAME", "PID", "URL", "UPTIME", "CONFIG")]
    rows += [(server_name(s), str(s.pid), s.url, duration(now - s.started), s.config or "-") for s in servers]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[4] for row in rows]


def select(servers: Sequence[RunningServer], name: str | None, every: bool = False) -> list[RunningServer]:
    """The servers `stop NAME` / `stop --all` / `stop` (the only one running) means."""
    if every or (name is None and len(servers) <= 1):
        return list(servers)
    names = ", ".join(server_name(s) for s in servers)
    if name is None:
        raise StopError(f"{len(servers)} servers are running ({names}): name one, or give --all")
    matches = [s for s in servers if name in (server_name(s), str(s.pid), Path(s.config or "").stem)]
    if not matches:
        raise StopError(f"no running server named {name!r} (running: {names or 'none'}; see strata-desk ps)")
    return matches


def stop(server: RunningServer, timeout: float = 10) -> None:
    """SIGTERM the server (it ends its engine), kill what is left after `timeout` s, drop its record."""
    try:
        terminate_tree(server.pid, timeout)
    finally:
        state.forget(server.pid)
