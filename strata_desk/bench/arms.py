"""Bench arms as an iterator: for each arm the config is rewritten with its settings and the server
restarted, then the arm's server is handed to the caller, who runs the table against it.

When the iteration ends (or is closed early, by an error), the config is restored and the server is
left as it was found: restarted with the original config if it was running (or was the caller's),
stopped if bench started it. Close it with `contextlib.aclosing` so that happens at once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from server.config import ConfigError, load_config, save_config, validate_config
from server.urls import host_port
from strata_desk.bench.spec import BenchSpec
from strata_desk.launcher import LaunchError, ServerProcess, call_back, running_for


@dataclass(frozen=True)
class ArmServer:
    """The server restarted with arm number `index`'s settings, ready at `url`."""

    index: int
    arm: dict[str, Any]
    url: str
    key: str | None


async def arm_servers(spec: BenchSpec, server: ServerProcess | None,
                      on_status: Callable[[str], Any] | None) -> AsyncIterator[ArmServer]:
    """Every arm's server in turn; `server`: the caller's (the dashboard's), else bench starts or adopts one."""
    config_path = spec.config or (server.config_path if server else None)
    if config_path is None:
        raise ConfigError("arms need the server's config file (--config)")
    original = load_config(config_path)
    base = original.model_dump(mode="json", exclude_defaults=True)
    configs = []
    for arm in spec.arms:  # validate every arm before anything is restarted
        try:
            configs.append(validate_config({**base, **arm}, f"arm {arm}"))
        except ConfigError as exc:
            raise ConfigError(f"{exc} (arm settings are config keys, e.g. parallel=2)") from None
    keep_running = server is not None
    if server is None:
        found = running_for(config_path)
        if found is not None:
            server = ServerProcess.adopt(found)
            keep_running = True
        else:
            host, port = host_port(spec.url) if spec.url else (None, None)
            server = ServerProcess(config_path, host=host, port=port)
    key = spec.key or original.api_key
    try:
        for index, (arm, config) in enumerate(zip(spec.arms, configs, strict=True)):
            save_config(config, config_path)
            await call_back(on_status, f"arm {index + 1}/{len(configs)} {arm}: restarting the server")
            if server.running:
                await server.arestart()
            else:
                server.start()
            await server.wait_ready(spec.ready_timeout, on_status)
            yield ArmServer(index, arm, server.url, key)
    finally:
        save_config(original, config_path)
        try:
            if keep_running:
                await call_back(on_status, "restoring the original config and restarting the server")
                await server.arestart()
                await server.wait_ready(spec.ready_timeout, on_status)
            else:
                await server.astop()
        except LaunchError as exc:
            await call_back(on_status, f"could not restart the server with the original config: {exc}")
