"""The run config `strata-<model>.json`: one validated model, loaded and written in one place.

Keys follow upstream's where they exist (model, model_name, host, port, api_key, gpu, layer_split,
parallel, args, env, sampling, log); the tuning options the dashboard edits are first-class keys
here and become engine flags in `engine_args()`. docs/config.md documents every key.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engine.protocol import (
    CONVERSATION_CACHE_MIB,
    CONVERSATION_CACHE_SLOTS,
    MAX_SLOTS,
    PREFILL_AUTO_MAX,
    VRAM_RESERVE_MIB,
)
from engine.split_spec import parse_split


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key and what is allowed."""


class SamplingFields(BaseModel):
    """The sampling keys and their limits, shared by the config's defaults and the API's bodies
    (the engine checks the same limits again in engine.protocol.Sampling.validate)."""

    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    max_tokens: int | None = Field(None, ge=1)
    repeat_penalty: float | None = Field(None, gt=0, le=10)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repeat_last_n: int | None = Field(None, ge=-1)


class SamplingDefaults(SamplingFields):
    model_config = ConfigDict(extra="forbid")




class RunConfig(BaseModel):
    """Everything needed to start the server and its engine for one model."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: str = Field(description="path to the .gguf file (or the first part of a split file)")
    model_name: str | None = Field(None, description="name clients see in /v1/models")
    host: str = Field("127.0.0.1", description="address to bind; beyond loopback needs api_key")
    port: int = Field(8080, ge=1, le=65535)
    api_key: str | None = Field(None, description="clients send it as Bearer or x-api-key")
    allowed_hosts: list[str] = Field(default_factory=list, description="extra Host names accepted")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    gpu: str | None = Field(None, description="CUDA_VISIBLE_DEVICES for the engine, e.g. '0,1'")
    layer_split: str | None = Field(
        None, description="layer split across GPUs: the first layer of each later GPU, e.g. '24' or '12,24,36', or 'auto'"
    )
    context: int = Field(4096, ge=256, le=1 << 20, description="context length in tokens")
    prefill: Annotated[int, Field(ge=16, le=32768)] | Literal["auto"] = Field(
        512, description="prompt chunk size in tokens, or 'auto' (on a GPU the largest up to 8192 whose buffers fit)")
    kv: Literal["auto", "f32", "f16", "bf16", "q8_0"] = Field(
        "auto", description="KV cache storage (auto: f16 on CPU, bf16 on GPU; q8_0: 8-bit blocks, CPU only)")
    parallel: int = Field(1, ge=1, le=MAX_SLOTS, description="batch slots; 1 = one request at a time")
    batch_groups: int | Literal["auto"] = Field("auto", description="pipeline groups; must divide parallel")
    batch_mtp: bool = False
    expert_cache: int | Literal["auto"] | None = Field(
        None, description="expert tier: cache slots over all layers, or 'auto'; none = every expert resident"
    )
    expert_profile: str | None = Field(None, description="routing profile (JSON) seeding the expert cache")
    expert_profile_save: str | None = Field(None, description="the engine writes its routing counts here on exit")
    adapt_every: int = Field(4, ge=0, description="re-rank the expert tier every N windows (0 = off)")
    adapt_swaps: int = Field(96, ge=0)
    adapt_decay: float = Field(0.7, gt=0, le=1)
    adapt_async: bool = False
    adapt_min_gain: float = Field(1.5, ge=1)
    adapt_min_count: float = Field(3.0, ge=0, description="routing count an uncached expert needs to displace a cached one")
    pcie_frac: float = Field(-1.0, ge=-1, le=1, description="-1 = the engine chooses, else a share in [0, 1]")
    vram_reserve_mib: int = Field(VRAM_RESERVE_MIB, ge=0, le=1 << 20,
                                  description="VRAM left free beside the expert cache by expert_cache auto, MiB")
    mmap_experts: bool = Field(False, description="GPU expert tier: routed experts left in the file's memory map "
                                                 "instead of pinned RAM (the engine does so itself when RAM is short)")
    prefill_borrow: bool = Field(True, description="GPU expert tier: prompt chunks borrow cache slots for their "
                                                   "MoE buffers (false: expert_cache auto leaves room for them)")
    conversation_cache_mib: int = Field(
        CONVERSATION_CACHE_MIB, ge=0, le=1 << 20, description="host RAM for conversations parked when their slot is taken, MiB (0 = off)"
    )
    conversation_cache_slots: int = Field(CONVERSATION_CACHE_SLOTS, ge=0, le=256, description="most conversations parked (0 = off)")
    exact: bool = Field(False, description="row-invariant arithmetic: batch tokens equal solo tokens")
    cpu_activations: Literal["int16", "int8", "float"] = Field(
        "int16", description="CPU decode products: int16 activations (faster), int8 (llama.cpp's rounding: "
        "fastest, logits move more) or float32 (the reference's)"
    )
    cuda_graphs: bool = Field(True, description="replay decode windows from CUDA graphs (GPU, no layer split)")
    cpu_plans: bool = Field(True, description="replay decode windows from CPU plans (CPU, no expert cache)")
    dense_copies: bool = Field(True, description="GPU: the layers' dense matrices and a Q6_K head dequantized once "
                               "into the VRAM left free, for windows of 2-8 rows and prompt chunks (none in exact mode)")
    queue_limit: int = Field(64, ge=1, le=4096, description="requests waiting beyond which 503")
    max_body_bytes: int = Field(4 << 20, ge=1024)
    engine_silence_s: float = Field(300.0, ge=0, description="watchdog during a request (0 = off)")
    args: list[str] = Field(default_factory=list, description="extra engine arguments")
    env: dict[str, str] = Field(default_factory=dict, description="extra engine environment")
    engine_command: list[str] | None = Field(
        None, description="advanced: the engine program (default: this Python with -m engine)"
    )
    sampling: SamplingDefaults = Field(default_factory=SamplingDefaults)
    log: str | None = Field(None, description="engine log file (default: the user log dir)")
    tokenizer: Literal["gguf", "bytes"] = Field(
        "gguf", description="'gguf': the model's own vocabulary; 'bytes': one id per byte (the HashLM test model)"
    )
    keepalive_s: float = Field(10.0, gt=0, le=300, description="SSE keep-alive comment interval")

    @field_validator("batch_groups", mode="before")
    @classmethod
    def _groups(cls, value: Any) -> Any:
        if value == "auto" or (isinstance(value, int) and value >= 1):
            return value
        raise ValueError("must be 'auto' or an integer >= 1")

    @field_validator("expert_cache", mode="before")
    @classmethod
    def _cache(cls, value: Any) -> Any:
        if value is None or value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            return value
        raise ValueError("must be 'auto' or a number of slots >= 0")

    @field_validator("layer_split", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        if value is None or not isinstance(value, str):
            return value
        parse_split(value)  # the format; the layers and GPUs are the engine's to check
        return value.strip() or None

    @field_validator("pcie_frac")
    @classmethod
    def _pcie(cls, value: float) -> float:
        if value != -1 and not 0 <= value <= 1:
            raise ValueError("must be -1 (the engine chooses) or in [0, 1]")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        if isinstance(self.batch_groups, int) and self.parallel % self.batch_groups:
            raise ValueError(f"batch_groups ({self.batch_groups}) must divide parallel ({self.parallel})")
        return self

    def engine_args(self) -> list[str]:
        """The engine's command line (without the program itself)."""
        out = ["--serve", "--model", self.model, "--max-context", str(self.context), "--prefill", str(self.prefill)]
        if self.device != "auto":
            out += ["--device", self.device]
        if self.kv != "auto":
            out += ["--kv", self.kv]
        if self.parallel > 1:
            out += ["--batch", str(self.parallel)]
            if self.batch_groups != "auto":
                out += ["--batch-groups", str(self.batch_groups)]
        if self.exact:
            out.append("--exact")
        if self.cpu_activations != "int16":
            out += ["--cpu-activations", self.cpu_activations]
        if not self.cuda_graphs:
            out += ["--cuda-graphs", "off"]
        if not self.cpu_plans:
            out += ["--cpu-plans", "off"]
        if not self.dense_copies:
            out += ["--dense-copies", "off"]
        out += ["--adapt-every", str(self.adapt_every), "--adapt-swaps", str(self.adapt_swaps)]
        out += ["--adapt-decay", f"{self.adapt_decay:g}", "--adapt-min-gain", f"{self.adapt_min_gain:g}",
                "--adapt-min-count", f"{self.adapt_min_count:g}"]
        out += ["--pcie-frac", f"{self.pcie_frac:g}"]
        if self.expert_cache is not None:
            out += ["--expert-cache", str(self.expert_cache), "--vram-reserve-mib", str(self.vram_reserve_mib)]
            if not self.prefill_borrow:
                out.append("--no-prefill-borrow")
            if self.mmap_experts:
                out.append("--mmap-experts")
        for flag, path in (("--expert-profile", self.expert_profile), ("--expert-profile-save", self.expert_profile_save)):
            if path:
                out += [flag, path]
        if self.adapt_async:
            out += ["--adapt-async", "1"]
        if self.batch_mtp:
            out.append("--batch-mtp")
        if self.layer_split:
            out += ["--layer-split", self.layer_split]
        out += ["--conversation-cache-mib", str(self.conversation_cache_mib),
                "--conversation-cache-slots", str(self.conversation_cache_slots)]
        return out + list(self.args)

    def engine_command_line(self) -> list[str]:
        program = self.engine_command or [sys.executable, "-m", "engine"]
        return [*program, *self.engine_args()]

    def engine_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.env)
        if self.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.gpu
        return env

    @property
    def served_name(self) -> str:
        return self.model_name or Path(self.model).stem

    @property
    def prefill_most(self) -> int:
        """The largest prompt chunk the engine may read (`auto`: up to PREFILL_AUTO_MAX), for the watchdog."""
        return PREFILL_AUTO_MAX if self.prefill == "auto" else self.prefill


def _describe(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(config)"
        got = e.get("input")
        shown = "" if isinstance(got, dict) else f" (got {got!r})"
        lines.append(f"{key}: {e['msg']}{shown}")
    return "; ".join(lines)


def validate_config(data: dict[str, Any], source: str = "config") -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"{source}: {_describe(err)}") from None


def load_config(path: str | Path) -> RunConfig:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a JSON object")
    return validate_config(data, str(path))


def save_config(config: RunConfig, path: str | Path) -> Path:
    """Write atomically (temp file + rename), keeping the previous file as `<name>.bak`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(config.model_dump(mode="json", exclude_defaults=True), indent=2) + "\n"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    if path.exists():
        os.replace(path, path.with_name(path.name + ".bak"))
    os.replace(tmp, path)
    return path
