"""Where strata-desk keeps its files (platformdirs), and the name of a model's config.

Every directory can be moved at once with `STRATA_DESK_HOME` (then `config/`, `logs/`, `data/`,
`cache/` and `state/` live under it): tests and portable installs use that. Otherwise the XDG variables
(`XDG_CONFIG_HOME`, `XDG_STATE_HOME`, ...) apply on Linux, as platformdirs reads them.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import platformdirs

from server.app_dirs import APP
from server.app_dirs import HOME_ENV as HOME_ENV
from server.app_dirs import home as _home
from server.app_dirs import log_dir as log_dir  # the server's default engine log is there too

_SPLIT_SUFFIX = re.compile(r"-\d{5}-of-\d{5}$")


def config_dir() -> Path:
    """The run configs `strata-<model>.json` live here."""
    home = _home()
    return home / "config" if home else platformdirs.user_config_path(APP)


def data_dir() -> Path:
    """Benchmark results and other data worth keeping."""
    home = _home()
    return home / "data" if home else platformdirs.user_data_path(APP)


def cache_dir() -> Path:
    """Files that can be fetched or made again: the demo models (and, engine/kernels/cpu.py, the
    compiled kernels)."""
    home = _home()
    return home / "cache" if home else platformdirs.user_cache_path(APP)


def state_dir() -> Path:
    """The record of running servers and the last used config."""
    home = _home()
    return home / "state" if home else platformdirs.user_state_path(APP)


def model_tag(model: Path) -> str:
    """`Qwen3-30B-A3B-Q4_K_M-00001-of-00003.gguf` -> `qwen3-30b-a3b-q4_k_m`."""
    stem = _SPLIT_SUFFIX.sub("", Path(model).name.removesuffix(".gguf").removesuffix(".GGUF"))
    tag = re.sub(r"[^a-z0-9._-]+", "-", stem.lower()).strip("-.")
    return tag or "model"


def config_path_for(model: Path) -> Path:
    """`<config dir>/strata-<model tag>.json`."""
    return config_dir() / f"strata-{model_tag(model)}.json"


def log_path_for(config_path: Path) -> Path:
    """The server's log file for one config (stdout and stderr of `python -m server`)."""
    return log_dir() / f"{Path(config_path).stem}.server.log"


def list_configs() -> list[Path]:
    """Every `strata-*.json` in the config dir, sorted by name."""
    folder = config_dir()
    return sorted(folder.glob("strata-*.json")) if folder.is_dir() else []


def _last_file() -> Path:
    return state_dir() / "last.json"


def remember_last_config(path: Path) -> None:
    """Record the config the user last ran, for a bare `strata-desk`."""
    folder = state_dir()
    folder.mkdir(parents=True, exist_ok=True)
    tmp = _last_file().with_suffix(".tmp")
    tmp.write_text(json.dumps({"config": str(Path(path).resolve())}) + "\n", encoding="utf-8")
    os.replace(tmp, _last_file())


def last_config() -> Path | None:
    """The last used config if it still exists, else the only config there is, else None."""
    try:
        value = json.loads(_last_file().read_text(encoding="utf-8")).get("config")
    except (OSError, ValueError, AttributeError):
        value = None
    if value and Path(value).is_file():
        return Path(value)
    configs = list_configs()
    return configs[0] if len(configs) == 1 else None
