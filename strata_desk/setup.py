"""Setup: probe the machine, read the model's header, recommend `parallel`, write the config.

The recommendation follows the seed's rule (upstream #465, v0.1.41): the expert cache is the sum
over cards of (VRAM - ~5 GB); n batch slots are allowed when the slots take at most a fifth of that
cache AND at least half of the model's expert bytes still fit beside them; the largest allowed n up
to 4 is recommended, else one at a time. A slot's size is its KV cache at the chosen context in
bf16 (the engine keeps KV in bf16 on a GPU). `--parallel N` (1..MAX_SLOTS) is kept as asked, with a
note when it is more than the rule would recommend. The dashboard's first-run screen calls
`build_config` and `write_config` as `strata-desk setup` does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from engine.protocol import VRAM_RESERVE_MIB
from server.config import MAX_SLOTS, ConfigError, RunConfig, load_config, save_config, validate_config
from strata_desk import paths
from strata_desk.modelfacts import GIB, ModelFacts
from strata_desk.probe import HardwareInfo, probe_hardware

RESERVE_GIB = 5.0  # VRAM each card keeps for weights, activations and the CUDA context (the seed's rule)
CUDA_CONTEXT_GIB = 0.5  # the CUDA context and torch's workspace on the engine's card
SLOT_SHARE = 0.2  # the slots may take at most a fifth of the expert cache
EXPERT_SHARE = 0.5  # at least half of the model's experts must still fit beside the slots
MAX_RECOMMENDED = 4
DEFAULT_CONTEXT = 32768
COST_NOTE = "parallel N reduces waiting for several users but costs about 10-25% speed per request on this card"


class SetupError(ValueError):
    """Setup cannot go on; the message names the file or value and the problem."""


@dataclass(frozen=True)
class Recommendation:
    parallel: int  # what setup recommends (1 = one at a time)
    device: str  # "cuda" or "cpu"
    cache_gib: float  # the expert cache: sum over cards of (VRAM - reserve)
    slot_gib: float  # one slot's session at the context
    expert_gib: float  # the model's routed experts
    messages: list[str] = field(default_factory=list)


def _allowed(n: int, cache: float, slot: float, experts: float) -> bool:
    return n * slot <= SLOT_SHARE * cache and cache - n * slot >= EXPERT_SHARE * experts


def recommend(gpus_vram_gib: list[float], facts: ModelFacts, context: int) -> Recommendation:
    """The seed's rule, pure: VRAM of each card in GiB, the model's facts, the context in tokens."""
    slot = facts.slot_bytes(context) / GIB
    experts = facts.expert_gib
    if not gpus_vram_gib:
        return Recommendation(1, "cpu", 0.0, slot, experts, [
            "no GPU: the engine runs on the CPU, where setup recommends one request at a time "
            "(parallel 1): batch slots save little there"
        ])
    cache = sum(max(0.0, v - RESERVE_GIB) for v in gpus_vram_gib)
    best = 1
    for n in range(2, MAX_RECOMMENDED + 1):
        if _allowed(n, cache, slot, experts):
            best = n
    cards = f"{len(gpus_vram_gib)} GPUs" if len(gpus_vram_gib) > 1 else "the GPU"
    if best > 1:
        msg = (f"parallel {best} recommended: up to {best} requests decode together; each slot takes "
               f"~{slot:.2f} GiB of VRAM from the expert cache ({cache:.1f} GiB on {cards})")
        return Recommendation(best, "cuda", cache, slot, experts, [msg])
    if 2 * slot > SLOT_SHARE * cache:
        why = (f"two slots ({2 * slot:.2f} GiB at {context} tokens) would take more than a fifth of "
               f"the expert cache ({cache:.1f} GiB on {cards})")
    else:
        why = (f"beside two slots the expert cache ({cache:.1f} GiB on {cards}) would hold less than "
               f"half of the model's experts ({experts:.1f} GiB)")
    return Recommendation(1, "cuda", cache, slot, experts, [f"left at one at a time: {why}", COST_NOTE])


def expert_tier(gpus_vram_gib: list[float], facts: ModelFacts, parallel: int, context: int) -> tuple[str | None, str]:
    """Whether the engine needs its expert tier (`expert_cache: auto`) on the first GPU, and why: the
    routed experts that do not fit beside the dense weights, the sessions, the CUDA context and the
    engine's reserve stay in RAM and the hottest of them are cached in VRAM."""
    card = gpus_vram_gib[0]
    sessions = (parallel + 1) * facts.slot_bytes(context) / GIB  # the slots and the solo session
    room = card - facts.dense_bytes / GIB - sessions - CUDA_CONTEXT_GIB - VRAM_RESERVE_MIB / 1024
    if room >= facts.expert_gib:
        return None, f"every routed expert fits in VRAM ({facts.expert_gib:.1f} GiB): no expert tier needed"
    cache = max(0.0, room - facts.layer_expert_bytes / GIB)  # less the misses' staging (at most a layer's experts)
    return "auto", (f"expert tier (expert_cache auto): about {cache:.1f} of the model's {facts.expert_gib:.1f} GiB "
                    f"of routed experts ({cache / facts.expert_gib:.0%}) cached in VRAM on GPU 0, the hottest "
                    "ones, learned while it serves; every expert stays in RAM")


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / (1 << 20):.1f} MiB"


def _default_context(facts: ModelFacts) -> int:
    trained = facts.context_length or 4096
    return max(256, min(trained, DEFAULT_CONTEXT))


def _choose_parallel(asked: int | None, rec: Recommendation) -> tuple[int, list[str]]:
    if asked is None:
        return rec.parallel, []
    if not 1 <= asked <= MAX_SLOTS:
        raise SetupError(f"--parallel must be 1..{MAX_SLOTS} (the engine runs at most {MAX_SLOTS} slots), "
                         f"got {asked}")
    notes = []
    chosen = asked
    if chosen > 1:
        notes.append(f"parallel {chosen}: up to {chosen} requests decode together, "
                     f"~{_size(chosen * rec.slot_gib * GIB)} of {'VRAM' if rec.device == 'cuda' else 'memory'} "
                     "for their sessions in all")
    if chosen > rec.parallel:
        notes.append(f"recommended for this machine: {rec.parallel}; kept as you chose ({chosen})")
    return chosen, notes


def build_config(
    model: Path,
    parallel: int | None = None,
    context: int | None = None,
    probe: Callable[[], HardwareInfo] | None = None,
) -> tuple[RunConfig, list[str]]:
    """A config for `model` with the recommendation applied, and the messages to show the user.

    An existing config for the same model is the starting point (its host, port, key, args ... are
    kept); model, context and parallel are set. `probe` defaults to `probe_hardware` (NVML, psutil).
    Raises SetupError for a missing or unreadable model or a bad value.
    """
    from engine.gguf_file import GGUFError

    model = Path(model).expanduser()
    if not model.is_file():
        raise SetupError(f"model file not found: {model}")
    try:
        facts = ModelFacts.from_gguf(model)
    except (GGUFError, FileNotFoundError) as exc:
        raise SetupError(str(exc)) from None
    hardware = (probe or probe_hardware)()
    messages = list(hardware.lines())
    kind = f"{facts.n_experts} experts ({facts.n_experts_used} per token), {_size(facts.expert_bytes)}"
    messages.append(f"model: {facts.architecture}, {facts.n_layers} layers, "
                    f"{'dense' if facts.dense else kind}, {_size(facts.total_bytes)} on disk")
    if context is None:
        context = _default_context(facts)
    elif context < 256:
        raise SetupError(f"--context must be at least 256 tokens (got {context})")
    if facts.context_length and context > facts.context_length:
        messages.append(f"context {context} is beyond the model's trained {facts.context_length} tokens")
    if hardware.ram_gib and facts.total_bytes > 0.9 * hardware.ram_gib * GIB:
        messages.append(f"the model ({facts.total_gib:.1f} GiB) barely fits or does not fit in RAM "
                        f"({hardware.ram_gib:.1f} GiB): expect swapping")
    rec = recommend(hardware.gpu_vram_gib, facts, context)
    chosen, notes = _choose_parallel(parallel, rec)
    messages += rec.messages if parallel is None else notes
    if parallel is not None and rec.device == "cpu" and chosen > 1:
        messages.append(rec.messages[0])

    target = paths.config_path_for(model)
    data: dict = {}
    if target.is_file():
        try:
            data = load_config(target).model_dump(mode="json", exclude_defaults=True)
            messages.append(f"updating {target} (its other settings are kept)")
        except ConfigError as exc:
            messages.append(f"existing config ignored ({exc}); a .bak keeps it")
    data.update(model=str(model.resolve()), context=context, parallel=chosen)
    if rec.device == "cuda" and not facts.dense and "expert_cache" not in data:
        cache, why = expert_tier(hardware.gpu_vram_gib, facts, chosen, context)
        messages.append(why)
        if cache is not None:
            data["expert_cache"] = cache
    if rec.device == "cuda" and "prefill" not in data and not any(facts.windows):
        # not with sliding-window layers: their rings hold window + the largest chunk in every session
        data["prefill"] = "auto"
        messages.append("prompts read in the largest chunks that fit the VRAM left (prefill auto, up to 8192 tokens)")
    groups = data.get("batch_groups")
    if isinstance(groups, int) and chosen % groups:
        data["batch_groups"] = "auto"
    try:
        return validate_config(data, str(target)), messages
    except ConfigError as exc:
        raise SetupError(str(exc)) from None


def write_config(config: RunConfig) -> Path:
    """Save `config` as `<config dir>/strata-<model>.json` (atomic, .bak kept); it becomes the last used."""
    path = save_config(config, paths.config_path_for(Path(config.model)))
    paths.remember_last_config(path)
    return path
