"""strata_desk.desktop: the .desktop launcher, icon, autostart and the systemd user unit.

The .desktop files are checked with `desktop-file-validate` (Debian/Ubuntu package
`desktop-file-utils`); the test says so and skips where it is not installed.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from strata_desk import desktop
from strata_desk.cli import main

VALIDATOR = shutil.which("desktop-file-validate")
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("STRATA_DESK_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(desktop, "_refresh_caches", lambda: None)


def _validate(path: Path) -> None:
    if VALIDATOR is None:
        pytest.skip("desktop-file-validate not installed (apt-get install desktop-file-utils)")
    result = subprocess.run([VALIDATOR, str(path)], capture_output=True, text=True)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_template_is_valid():
    _validate(ROOT / "assets" / "strata-desk.desktop")


def test_install_and_uninstall(tmp_path):
    exe = tmp_path / "my apps" / "bin" / "strata-desk"  # a space: Exec must quote it
    written = desktop.install_desktop(autostart=True, exe=exe)
    launcher = tmp_path / "data" / "applications" / "strata-desk.desktop"
    icon = tmp_path / "data" / "icons" / "hicolor" / "scalable" / "apps" / "strata-desk.svg"
    autostart = tmp_path / "config" / "autostart" / "strata-desk.desktop"
    assert set(written) == {launcher, icon, autostart}
    text = launcher.read_text()
    assert f'Exec="{exe}"' in text
    assert "Terminal=true" in text and "Icon=strata-desk" in text and "Categories=System;Monitor;" in text
    assert "@" not in text
    assert icon.read_text().lstrip().startswith("<?xml")
    _validate(launcher)
    _validate(autostart)
    removed = desktop.uninstall_desktop()
    assert set(removed) == {launcher, icon, autostart}
    assert not launcher.exists() and not icon.exists() and not autostart.exists()


def test_no_autostart_by_default(tmp_path):
    desktop.install_desktop(exe=Path("/usr/bin/strata-desk"))
    assert (tmp_path / "data" / "applications" / "strata-desk.desktop").is_file()
    assert not (tmp_path / "config" / "autostart").exists()
    text = (tmp_path / "data" / "applications" / "strata-desk.desktop").read_text()
    assert "Exec=/usr/bin/strata-desk\n" in text


def test_exec_quoting():
    assert desktop._desktop_quote("/usr/bin/x") == "/usr/bin/x"
    assert desktop._desktop_quote('/a b/"q"') == '"/a b/\\"q\\""'
    assert desktop._desktop_quote("/a/100%") == "/a/100%%"


def test_install_service(tmp_path):
    config = tmp_path / "strata-tiny.json"
    config.write_text('{"model": "/m/tiny.gguf"}')
    exe = Path("/opt/strata desk/bin/strata-desk")
    unit = desktop.install_service(config, exe=exe)
    assert unit == tmp_path / "config" / "systemd" / "user" / "strata-desk.service"
    text = unit.read_text()
    assert f'ExecStart="{exe}" serve --config {config.resolve()}' in text
    assert "WantedBy=default.target" in text and "@" not in text
    assert any("systemctl --user enable --now strata-desk.service" in c for c in desktop.service_commands())
    assert desktop.uninstall_service() == [unit]
    with pytest.raises(desktop.DesktopError, match="config file not found"):
        desktop.install_service(tmp_path / "missing.json", exe=exe)


def test_cli_install_desktop(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(desktop, "console_script", lambda: Path("/usr/local/bin/strata-desk"))
    assert main(["install-desktop", "--autostart"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert (tmp_path / "config" / "autostart" / "strata-desk.desktop").is_file()
    assert main(["install-desktop", "--uninstall"]) == 0
    assert not (tmp_path / "data" / "applications" / "strata-desk.desktop").exists()


def test_cli_install_service(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(desktop, "console_script", lambda: Path("/usr/local/bin/strata-desk"))
    assert main(["install-service"]) == 2  # no config yet
    assert "no config" in capsys.readouterr().err
    config = tmp_path / "strata-tiny.json"
    config.write_text('{"model": "/m/tiny.gguf"}')
    assert main(["install-service", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "systemctl --user daemon-reload" in out
    assert main(["install-service", "--uninstall"]) == 0
    assert not (tmp_path / "config" / "systemd" / "user" / "strata-desk.service").exists()
