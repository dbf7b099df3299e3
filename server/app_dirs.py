"""The one rule for where strata-desk's directories are: under `STRATA_DESK_HOME` when it is set
(`logs/`, `config/`, ...), else platformdirs' user directories (XDG on Linux).

It lives in the server package because the server names its default engine log without importing
`strata_desk`; `strata_desk.paths` builds every other directory on the same `home()`.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP = "strata-desk"
HOME_ENV = "STRATA_DESK_HOME"


def home() -> Path | None:
    """`$STRATA_DESK_HOME` (tests, portable installs), or None."""
    value = os.environ.get(HOME_ENV)
    return Path(value).expanduser() if value else None


def log_dir() -> Path:
    """Server and engine logs."""
    root = home()
    return root / "logs" if root else platformdirs.user_log_path(APP)
