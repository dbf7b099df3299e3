"""Which device runs which layers: the layer split (`--layer-split`) and the slots' pipeline groups
(`--batch-groups`).

A `Placement` is a list of `Stage`s, each a device and a range of layers. Stage 0 also holds the
embedding, the last stage the final norm and the head. With `--device cuda` stage k runs on `cuda:k`;
with `--device cpu` every stage runs on the CPU (two stages in one process: how CI exercises the
split). The hidden state goes from one stage to the next through a `Handoff`: one interface, so that
a stage in another process or host (torch.distributed send/recv) could replace the local copy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from engine.split_spec import parse_split


def on_device(t: torch.Tensor, device: torch.device) -> bool:
    """Whether `t` lives on `device` (`cuda` without an index, an unsplit engine's: any CUDA device)."""
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


@dataclass(frozen=True)
class Stage:
    """Layers `first` .. `end - 1` on `device`."""

    index: int
    device: torch.device
    first: int
    end: int

    @property
    def layers(self) -> range:
        return range(self.first, self.end)

    def label(self) -> str:
        """`0-11@cuda:0`, as INFO `layer_split` lists the stages."""
        return f"{self.first}-{self.end - 1}@{self.device}"

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The stage's device as CUDA's current device while its kernels are launched (Triton launches
        on the current device, not the tensors'); nothing to do on the CPU or on an unsplit engine's
        `cuda` (no index: the current device already)."""
        if self.device.type != "cuda" or self.device.index is None:
            yield
            return
        with torch.cuda.device(self.device):
            yield


@dataclass(frozen=True)
class Placement:
    stages: tuple[Stage, ...]

    @classmethod
    def single(cls, device: torch.device, layers: int) -> Placement:
        return cls((Stage(0, device, 0, layers),))

    @property
    def split(self) -> bool:
        return len(self.stages) > 1

    @property
    def first(self) -> Stage:
        return self.stages[0]

    @property
    def last(self) -> Stage:
        return self.stages[-1]

    def stage_of(self, layer: int) -> Stage:
        for stage in self.stages:
            if stage.first <= layer < stage.end:
                return stage
        raise IndexError(f"layer {layer} is in no stage ({self.describe()})")

    def device_of(self, layer: int) -> torch.device:
        return self.stage_of(layer).device

    def layers_on(self, device: torch.device) -> list[int]:
        """The layers the stages on `device` run."""
        return [i for s in self.stages if s.device == device for i in s.layers]

    def devices(self) -> list[torch.device]:
        """The stages' devices, each once, in stage order."""
        return list(dict.fromkeys(s.device for s in self.stages))

    def on_gpu(self) -> bool:
        """Whether a stage runs on a CUDA device."""
        return any(d.type == "cuda" for d in self.devices())

    def tensor_stage(self, name: str) -> Stage:
        """Where a GGUF tensor goes: `blk.N.*` with layer N, the final norm and head on the last stage,
        the rest (embedding) on the first."""
        if name.startswith("blk."):
            return self.stage_of(int(name.split(".")[1]))
        if name.removesuffix(".weight") in ("output", "output_norm"):
            return self.last
        return self.first

    def describe(self) -> str:
        return ",".join(s.label() for s in self.stages)


def plan_stages(spec: str, layers: int, device: torch.device, visible: int | None = None) -> Placement:
    """The placement `--layer-split spec` asks for on `device` (`visible`: the CUDA devices there are,
    torch's count when None).

    `""`: no split. `"auto"`: the layers evenly over the visible CUDA devices (on the CPU: no split).
    `"24"` / `"12,24,36"`: the first layer of each later stage, rising, each in 1 .. layers - 1.
    """
    spec = spec.strip()
    parsed = parse_split(spec)
    if device.type == "cuda" and visible is None:
        visible = torch.cuda.device_count()
    if parsed is None or (parsed == "auto" and (device.type != "cuda" or (visible or 0) < 2)):
        return Placement.single(device, layers)
    if parsed == "auto":
        n = min(visible or 1, layers)
        bounds = [round(k * layers / n) for k in range(1, n)]
    else:
        bounds = list(parsed)
        for b in bounds:
            if b >= layers:
                raise ValueError(f"--layer-split {spec!r}: layer {b} is out of range (a stage starts at a layer "
                                 f"in 1..{layers - 1}; the model has {layers} layers)")
    starts = [0, *bounds]
    if device.type == "cuda":
        if len(starts) > (visible or 0):
            raise ValueError(f"--layer-split {spec!r}: {len(starts)} stages need {len(starts)} CUDA devices, "
                             f"{visible} visible (CUDA_VISIBLE_DEVICES, the config's gpu)")
        devices = [torch.device("cuda", k) for k in range(len(starts))]
    else:
        devices = [device] * len(starts)
    ends = [*bounds, layers]
    return Placement(tuple(Stage(k, devices[k], starts[k], ends[k]) for k in range(len(starts))))


def plan_groups(asked: str, slots: int, stages: int) -> tuple[int, str | None]:
    """(groups to run, a note for the log when that is not what was asked) for `--batch-groups asked`.

    `auto`: one group per stage, at most what divides the slots; a number: the most groups up to it
    that divide the slots. Never refused: a count the engine cannot run is lowered and said so.
    """
    if asked != "auto":
        try:
            want = int(asked)
        except ValueError:
            raise ValueError(f"--batch-groups {asked!r}: expected 'auto' or a number of groups >= 1") from None
        if want < 1:
            raise ValueError(f"--batch-groups {asked!r}: expected 'auto' or a number of groups >= 1")
    else:
        want = stages
    if slots < 2:
        note = None if want == 1 or asked == "auto" else f"--batch-groups {asked}: no batch slots; one window"
        return 1, note
    runs = max(g for g in range(1, min(want, slots) + 1) if slots % g == 0)
    if asked != "auto" and runs != want:
        return runs, f"--batch-groups {asked}: {slots} slots; running {runs} groups of {slots // runs}"
    return runs, None


class Handoff:
    """How the hidden state goes from one stage to the next. A torch.distributed implementation would
    `dist.send` the rows on the rank of `src` and `dist.recv` them into a buffer on the rank of `dst`
    (the row count is known to both: every rank builds the same batch)."""

    def move(self, x: torch.Tensor, src: Stage, dst: Stage) -> torch.Tensor:
        raise NotImplementedError


class LocalHandoff(Handoff):
    """Stages in this process: a device-to-device copy, queued behind `src`'s kernels without a host
    wait (nothing at all when both stages are on the same device)."""

    def move(self, x: torch.Tensor, src: Stage, dst: Stage) -> torch.Tensor:
        return x.to(dst.device, non_blocking=True)
