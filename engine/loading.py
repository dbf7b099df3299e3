"""From a path and a few options to a loaded model: device, dtype, context and how many slots fit."""

from __future__ import annotations

import sys
from collections.abc import Mapping

import torch

from engine.gguf_file import GGUFError, GGUFFile
from engine.hyper import Hyper
from engine.kv import KV_DTYPES, KVCache
from engine.memory import MIB, free_bytes
from engine.models import load_model
from engine.models.base import Model
from engine.placement import Placement, plan_stages
from engine.protocol import MAX_SLOTS
from engine.weights import resident_bytes

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
RESERVE = 1024 * MIB  # left free beside weights and sessions


def log(msg: str) -> None:
    print(f"strata-engine: {msg}", file=sys.stderr, flush=True)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise GGUFError("--device cuda: CUDA is not available in this torch build or on this machine")
    return torch.device(name)


def pick_dtype(name: str | None, device: torch.device) -> torch.dtype:
    return DTYPES[name or ("f32" if device.type == "cpu" else "bf16")]


def model_context(g: GGUFFile, asked: int) -> int:
    """The context to run at: as asked, at most the model's, at least 64 tokens."""
    return max(64, min(asked, int(g.arch_key("context_length", asked))))


def pick_kv_dtype(name: str | None, device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """KV storage: as asked (q8_0: the CPU only), else fp16 on the CPU (half the bytes of float32, more
    mantissa than bf16) and the compute dtype on a GPU (no cast per attention call)."""
    if name == "q8_0" and device.type != "cpu":
        raise ValueError("--kv q8_0 runs on the CPU only for now (the GPU's attention kernel reads float caches): "
                         "use bf16 or f16 on a GPU")
    if name:
        return KV_DTYPES[name]
    return torch.float16 if device.type == "cpu" else dtype


def session_bytes(g: GGUFFile, context: int, max_chunk: int, kv_dtype: torch.dtype,
                  layers: range | None = None) -> int:
    """One session's KV bytes, sliding-window rings included (of `layers` only, when given)."""
    h = Hyper.from_gguf(g)
    windows = h.windows if layers is None else tuple(h.windows[i] for i in layers)
    return KVCache.bytes_per_session(windows, h.kv_heads, context, h.head_dim, max_chunk, kv_dtype)


def planned_on(g: GGUFFile, placement: Placement, device: torch.device, dtype: torch.dtype,
               host_experts: bool | str = False) -> int:
    """The weights' bytes `device` will hold under `placement`, before loading them (without the routed
    expert stacks with `host_experts`: they stay in host memory)."""
    infos = [info for info in g.tensors.values() if placement.tensor_stage(info.name).device == device
             and not (host_experts and "_exps" in info.name)]
    if "output.weight" not in g.tensors and device == placement.last.device != placement.first.device:
        infos.append(g.tensors["token_embd.weight"])  # a tied head's copy on the last stage
    return sum(resident_bytes(info, device, dtype) for info in infos)


def fit_slots(asked: int, g: GGUFFile, context: int, dtype: torch.dtype, device: torch.device,
              max_chunk: int, kv_dtype: torch.dtype, placement: Placement | None = None,
              host_experts: bool | str = False, taken: Mapping[str, int] | None = None) -> int:
    """As many slots as asked that fit in memory beside the weights (the routed experts elsewhere with
    `host_experts`) and `taken` bytes per device (`str(device)`: an expert cache), on every device of the
    placement (the weights and KV layers each holds); 0 when not two fit."""
    if asked <= 0:
        return 0
    if asked > MAX_SLOTS:
        log(f"--batch {asked}: a window holds at most {MAX_SLOTS} slots; running {MAX_SLOTS}")
    n = min(asked, MAX_SLOTS)
    placement = placement or Placement.single(device, Hyper.from_gguf(g).layers)
    for dev in placement.devices():
        layers = placement.layers_on(dev)
        per_session = session_bytes(g, context, max_chunk, kv_dtype, layers)
        weights = planned_on(g, placement, dev, dtype, host_experts) + (taken or {}).get(str(dev), 0)
        free, _ = free_bytes(dev)
        fit = max(0, (free - weights - RESERVE) // max(per_session, 1) - 1)  # the solo session comes first
        if fit < n:
            n = int(fit)
            log(f"--batch {asked}: {n} slots fit on {dev} ({per_session / MIB:.0f} MiB each at context {context}, "
                f"{free / MIB:.0f} MiB free before loading)")
    return n if n >= 2 else 0


def placement_of(g: GGUFFile, device: str, layer_split: str = "") -> Placement:
    """The stages `--device device --layer-split layer_split` gives `g`'s layers."""
    return plan_stages(layer_split, Hyper.from_gguf(g).layers, pick_device(device))


def open_model(path: str, device: str = "auto", dtype: str | None = None, slots: int = 0,
               context: int = 4096, max_chunk: int = 512, kv: str | None = None,
               layer_split: str = "", host_experts: bool | str = False) -> tuple[GGUFFile, Model]:
    """Load `path` with room for `slots` batch sessions beside the solo session, its layers split as
    `--layer-split layer_split` says (routed experts in host memory with `host_experts`, for the GPU
    expert tier)."""
    g = GGUFFile(path)
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    placement = placement_of(g, device, layer_split)
    return g, load_model(g, dev, dt, sessions=slots + 1, context=model_context(g, context),
                         max_chunk=max_chunk, kv_dtype=pick_kv_dtype(kv, dev, dt), placement=placement,
                         host_experts=host_experts)
