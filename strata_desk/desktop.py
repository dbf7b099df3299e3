"""`install-desktop` (a freedesktop launcher + icon, optionally autostart) and `install-service`
(a systemd user unit for headless `strata-desk serve`).

Files go to the XDG locations ($XDG_DATA_HOME, default ~/.local/share; $XDG_CONFIG_HOME, default
~/.config); `--uninstall` removes exactly the files these commands write. Nothing here runs
systemctl: the commands to enable the unit are returned for the user to run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

APP_ID = "strata-desk"
DESKTOP_NAME = f"{APP_ID}.desktop"
SERVICE_NAME = f"{APP_ID}.service"


class DesktopError(RuntimeError):
    """Something the install cannot do; the message says what."""


def data_home() -> Path:
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")


def config_home() -> Path:
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")


def assets_dir() -> Path:
    """The templates: `assets/` of a source checkout, else `<prefix>/share/strata-desk/assets`."""
    for candidate in (Path(__file__).resolve().parent.parent / "assets",
                      Path(sys.prefix) / "share" / APP_ID / "assets"):
        if (candidate / DESKTOP_NAME).is_file():
            return candidate
    raise DesktopError("the desktop templates (assets/strata-desk.desktop) are not installed")


def console_script() -> Path:
    """The absolute path of the installed `strata-desk` script (next to this Python, else on PATH)."""
    beside = Path(sys.executable).parent / APP_ID
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside.absolute()
    found = shutil.which(APP_ID)
    if found:
        return Path(found).absolute()
    raise DesktopError("the strata-desk command is not installed (pip install the package first)")


def _desktop_quote(arg: str) -> str:
    """Quote one Exec argument as the Desktop Entry spec asks (and escape a literal %)."""
    arg = arg.replace("%", "%%")
    if any(c in arg for c in ' \t\n"\'\\><~|&;$*?#()`'):
        escaped = "".join("\\" + c if c in '"`$\\' else c for c in arg)
        return f'"{escaped}"'
    return arg


def _systemd_quote(arg: str) -> str:
    arg = arg.replace("%", "%%")
    if any(c in arg for c in ' \t"\'\\'):
        return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return arg


def desktop_paths(autostart: bool = True) -> dict[str, Path]:
    out = {
        "desktop": data_home() / "applications" / DESKTOP_NAME,
        "icon": data_home() / "icons" / "hicolor" / "scalable" / "apps" / f"{APP_ID}.svg",
    }
    if autostart:
        out["autostart"] = config_home() / "autostart" / DESKTOP_NAME
    return out


def render_desktop(exe: Path) -> str:
    template = (assets_dir() / DESKTOP_NAME).read_text(encoding="utf-8")
    return template.replace("@EXEC@", _desktop_quote(str(exe))).replace("@TRYEXEC@", str(exe))


def _refresh_caches() -> None:
    tool = shutil.which("update-desktop-database")
    if tool:
        subprocess.run([tool, str(data_home() / "applications")], check=False, capture_output=True)


def install_desktop(autostart: bool = False, exe: Path | None = None) -> list[Path]:
    """Write the launcher and the icon (and the autostart entry); returns the files written."""
    exe = Path(exe) if exe else console_script()
    text = render_desktop(exe)
    targets = desktop_paths(autostart)
    written = []
    for kind, target in targets.items():
        target.parent.mkdir(parents=True, exist_ok=True)
        if kind == "icon":
            shutil.copyfile(assets_dir() / f"{APP_ID}.svg", target)
        else:
            target.write_text(text, encoding="utf-8")
        written.append(target)
    _refresh_caches()
    return written


def uninstall_desktop() -> list[Path]:
    """Remove what install_desktop writes (autostart included); returns the files removed."""
    removed = []
    for target in desktop_paths(autostart=True).values():
        if target.is_file():
            target.unlink()
            removed.append(target)
    _refresh_caches()
    return removed


def service_path() -> Path:
    return config_home() / "systemd" / "user" / SERVICE_NAME


def render_service(config: Path, exe: Path) -> str:
    template = (assets_dir() / SERVICE_NAME).read_text(encoding="utf-8")
    return (template.replace("@EXEC@", _systemd_quote(str(exe)))
            .replace("@CONFIG@", _systemd_quote(str(config)))
            .replace("@CONFIG_NAME@", config.name.replace("%", "%%")))


def service_commands() -> list[str]:
    return [
        "systemctl --user daemon-reload",
        f"systemctl --user enable --now {SERVICE_NAME}",
        "loginctl enable-linger $USER   # keep it running when you are logged out",
        f"journalctl --user -u {SERVICE_NAME} -f   # follow its log",
    ]


def install_service(config: Path, exe: Path | None = None) -> Path:
    """Write the systemd user unit that runs `strata-desk serve --config CONFIG`."""
    config = Path(config).expanduser().resolve()
    if not config.is_file():
        raise DesktopError(f"config file not found: {config}")
    exe = Path(exe) if exe else console_script()
    target = service_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(render_service(config, exe), encoding="utf-8")
    return target


def uninstall_service() -> list[Path]:
    target = service_path()
    if target.is_file():
        target.unlink()
        return [target]
    return []
