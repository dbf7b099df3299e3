"""The expert tier's parts on their own: the adaptation policy's rounds, routing profiles, the slot
split and the engine flags that set the tier up (`setup_tier`), with every bad input refused."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from engine import protocol as P
from engine.__main__ import build_parser
from engine.check import main as check_main
from engine.loading import open_model
from engine.tier import AdaptPolicy, ProfileError, RoutingProfile, TierError, parse_expert_cache, split_slots
from engine.tier.flags import setup_tier
from engine.tier.policy import plan_round


def t(*counts: float) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.float64)


def test_round_swaps_only_when_the_gain_clears():
    counts = [t(10, 0, 14, 30)]  # slots hold experts 0 and 1; 3 is hot, 2 is warm
    plan = plan_round(counts, [[0, 1]], AdaptPolicy(min_gain=1.5))
    # 30 replaces 1 (count 0); 14 vs 10 is below 1.5x: expert 0 stays
    assert [(s.slot, s.expert) for s in plan] == [(1, 3)]
    plan = plan_round(counts, [[0, 1]], AdaptPolicy(min_gain=1.4))
    assert [(s.slot, s.expert) for s in plan] == [(1, 3), (0, 2)]


def test_an_expert_needs_the_minimum_count_to_displace_a_cached_one():
    counts = [t(0.2, 0.1, 2.5, 1)]  # cached experts 0 and 1 barely routed lately; 2 and 3 a little more
    assert plan_round(counts, [[0, 1]], AdaptPolicy(min_count=3.0)) == []  # 2.5 and 1 are below 3
    plan = plan_round(counts, [[0, 1]], AdaptPolicy(min_count=2.0))
    assert [(s.slot, s.expert) for s in plan] == [(1, 2)]
    plan = plan_round(counts, [[0, 1]], AdaptPolicy(min_count=0.0))  # upstream's rule: the ratio alone
    assert [(s.slot, s.expert) for s in plan] == [(1, 2), (0, 3)]
    plan = plan_round([t(0.2, 1, 0)], [[0, -1]], AdaptPolicy(min_count=3.0))  # an empty slot: any count fills it
    assert [(s.slot, s.expert) for s in plan] == [(1, 1)]


def test_round_takes_the_largest_gains_across_layers_up_to_the_cap():
    counts = [t(1, 50, 2, 0), t(0, 1, 9, 100)]
    plan = plan_round(counts, [[0, 2], [0, 1]], AdaptPolicy(swaps=2, min_gain=1.5))
    # candidates: layer 0: 50 over 1 (gain 49); layer 1: 100 over 0 (100), 9 over 1 (8)
    assert [(s.layer, s.expert, s.gain) for s in plan] == [(1, 3, 100.0), (0, 1, 49.0)]
    assert plan_round(counts, [[0, 2], [0, 1]], AdaptPolicy(swaps=0)) == []


def test_empty_slots_fill_first_whatever_the_cap_and_unrouted_experts_never_move_in():
    plan = plan_round([t(0, 5, 3, 0)], [[-1, -1, -1]], AdaptPolicy(swaps=0))
    assert [(s.slot, s.expert) for s in plan] == [(0, 1), (1, 2)]  # expert 0 and 3 were never routed


def test_any_routed_expert_displaces_one_never_routed_and_a_seed_round_has_no_cap():
    counts, at = [t(4, 0, 2, 1)], [[0, 1]]
    plan = plan_round(counts, at, AdaptPolicy())
    assert [(s.slot, s.expert) for s in plan] == [(1, 2)]  # 2 < --adapt-min-count 3, but expert 1 has 0
    assert plan_round([t(4, 0.5, 2, 1)], at, AdaptPolicy()) == []  # expert 1 was routed: 2 is under 3
    assert plan_round(counts, at, AdaptPolicy(swaps=0)) == []
    assert plan_round(counts, at, AdaptPolicy(swaps=0).seeding()) == plan
    seed = plan_round([t(4, 0.5, 2, 1)], at, AdaptPolicy(swaps=0, min_gain=5, min_count=9).seeding())
    assert [(s.slot, s.expert) for s in seed] == [(1, 2)]  # 2 over 0.5: the counts alone rank a seed round


@pytest.mark.parametrize(("kw", "message"), [
    ({"every": -1}, "--adapt-every must be >= 0"),
    ({"swaps": -2}, "--adapt-swaps must be >= 0"),
    ({"decay": 0.0}, "--adapt-decay must be in (0, 1]"),
    ({"decay": 1.5}, "--adapt-decay must be in (0, 1]"),
    ({"min_gain": 0.5}, "--adapt-min-gain must be >= 1"),
    ({"min_count": -1.0}, "--adapt-min-count must be >= 0"),
])
def test_bad_policy_values(kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("]", r"\]")):
        AdaptPolicy(**kw)


def test_policy_modes():
    assert not AdaptPolicy(every=0).adapts and not AdaptPolicy(every=1_000_000).adapts
    assert AdaptPolicy(every=4).due(8) and not AdaptPolicy(every=4).due(6)


def test_slots_spread_over_layers():
    assert split_slots(10, 4, 8) == [3, 3, 2, 2]
    assert split_slots(100, 4, 8) == [8, 8, 8, 8]
    with pytest.raises(TierError, match="slots >= 0"):
        split_slots(-1, 4, 8)


@pytest.mark.parametrize(("text", "message"), [("x", "got 'x'"), ("-3", "got -3"), ("1.5", "got '1.5'")])
def test_bad_expert_cache(text, message):
    with pytest.raises(TierError, match=message):
        parse_expert_cache(text)


def test_profile_round_trip_and_bad_files(tmp_path):
    path = tmp_path / "p.json"
    RoutingProfile("m.gguf", [[1, 2], [3, 0]]).save(path)
    back = RoutingProfile.load(path)
    assert back.counts == [[1, 2], [3, 0]] and back.model == "m.gguf"
    with pytest.raises(ProfileError, match="does not fit this model's 4 x 8"):
        back.check_shape(4, 8, path)
    cases = {"missing.json": "cannot read routing profile", "junk.json": "invalid JSON",
             "other.json": "not a routing profile", "ragged.json": "equal-length lists"}
    (tmp_path / "junk.json").write_text("{")
    (tmp_path / "other.json").write_text(json.dumps({"counts": [[1]]}))
    (tmp_path / "ragged.json").write_text(json.dumps({"format": "strata-expert-profile", "version": 1,
                                                      "counts": [[1, 2], [3]]}))
    for name, message in cases.items():
        with pytest.raises(ProfileError, match=message):
            RoutingProfile.load(tmp_path / name)


@pytest.fixture(scope="module")
def model(tiny_model):
    return open_model(str(tiny_model), "cpu")[1]


def _setup(model, *flags: str) -> dict:
    model.tier = None
    return setup_tier(build_parser().parse_args(["--model", "x.gguf", *flags]), model)


def test_setup_tier_from_flags(model, tmp_path):
    info = _setup(model, "--expert-cache", "12", "--adapt-every", "1000000", "--pcie-frac", "0.3", "--adapt-async", "1")
    assert model.tier is not None and model.tier.slots == 12 and model.tier.policy.every == 1_000_000
    assert info == {"expert_slots": 12, "experts_cached": 12, "pcie_frac": 0, "adapt_every": 1_000_000,
                    "adapt_async": 1, "expert_profile": "-", "prefill_borrow": 0,
                    "experts_mapped": 0}  # the simulated tier lends no VRAM and maps nothing
    assert model.tier.copier is not None
    path = tmp_path / "p.json"
    RoutingProfile("tiny", [[8, 7, 6, 5, 4, 3, 2, 1]] * 4).save(path)
    info = _setup(model, "--expert-cache", "8", "--expert-profile", str(path))
    assert info["experts_cached"] == 8 and info["expert_profile"] == "p.json"
    assert all(layer.slots.expert_at == [0, 1] for layer in model.tier.layers)
    assert _setup(model) == {} and model.tier is None  # no flag: every expert resident
    assert _setup(model, "--expert-cache", "auto") == {} and model.tier is None  # no VRAM to size from


@pytest.mark.parametrize(("flags", "message"), [
    (("--expert-cache", "-1"), "slots >= 0"),
    (("--expert-profile", "p.json"), "need an expert tier"),
    (("--expert-cache", "4", "--pcie-frac", "2"), "--pcie-frac must be -1 or in"),
    (("--expert-cache", "4", "--adapt-decay", "0"), "--adapt-decay"),
    (("--expert-cache", "4", "--expert-profile-save", "/no/such/dir/p.json"), "no directory /no/such/dir"),
    (("--expert-cache", "4", "--expert-profile", "/no/such.json"), "cannot read routing profile"),
])
def test_setup_tier_refuses(model, flags, message):
    with pytest.raises(ValueError, match=message):
        _setup(model, *flags)


def test_engine_process_runs_the_tier_and_saves_its_profile(tiny_model, tmp_path):
    saved = tmp_path / "profile.json"
    out = subprocess.run([sys.executable, "-m", "engine", "--serve", "--threads", "1", "--model", str(tiny_model),
                          "--expert-cache", "8", "--adapt-every", "2", "--expert-profile-save", str(saved)],
                         input="GEN 12 1,2,3\nQUIT\n", capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    r = [P.parse_reply(line) for line in out.stdout.splitlines()]
    info = r[0].values
    assert info["tier"] == "simulated" and info["expert_slots"] == 8 and "adapt_every" not in info["unsupported"]
    done = next(x for x in r if isinstance(x, P.Done))
    assert done.lookups == (done.generated - 1) * 4 * 2 and 0 <= done.hits <= done.lookups and done.offloaded == 0
    tier = [x for x in r if isinstance(x, P.Stats)][-1].data["tier"]  # what the server reads for /metrics
    assert tier["lookups"] == done.lookups and tier["adapt_rounds"] == (done.generated - 1) // 2 > 0
    assert tier["adapt_wait_total_ms"] > 0 and len(tier["hot"]) == 4
    assert all(h.keys() == {"layer", "expert", "share", "cached"} and 0 < h["share"] <= 1 for h in tier["hot"])
    assert "decode expert cache hit rate" in out.stderr and f"routing profile written to {saved}" in out.stderr
    profile = RoutingProfile.load(saved)
    assert profile.layers == 4 and profile.experts == 8 and sum(map(sum, profile.counts)) > 0


def test_run_config_tier_options():
    from pydantic import ValidationError

    from server.config import RunConfig

    base = RunConfig(model="m.gguf")
    assert "--expert-cache" not in base.engine_args() and base.adapt_swaps == 96 and base.adapt_decay == 0.7
    args = RunConfig(model="m.gguf", expert_cache=64, expert_profile="p.json", expert_profile_save="q.json",
                     pcie_frac=-1).engine_args()
    assert args[args.index("--expert-cache") + 1] == "64" and args[args.index("--expert-profile") + 1] == "p.json"
    assert args[args.index("--expert-profile-save") + 1] == "q.json" and args[args.index("--pcie-frac") + 1] == "-1"
    auto = RunConfig(model="m.gguf", expert_cache="auto").engine_args()
    assert auto[auto.index("--expert-cache") + 1] == "auto"
    # what the config writes, the engine's parser takes
    parsed = build_parser().parse_args(args)
    assert parsed.expert_cache == "64" and parsed.pcie_frac == -1 and parsed.prefill_borrow
    reserved = RunConfig(model="m.gguf", expert_cache="auto", prefill_borrow=False, mmap_experts=True).engine_args()
    assert "--no-prefill-borrow" in reserved and not build_parser().parse_args(reserved).prefill_borrow
    assert build_parser().parse_args(reserved).mmap_experts and not parsed.mmap_experts
    for bad in ({"expert_cache": -1}, {"expert_cache": "lots"}, {"expert_cache": True}, {"pcie_frac": -0.5}):
        with pytest.raises(ValidationError):
            RunConfig(model="m.gguf", **bad)


@pytest.mark.parametrize("asynchronous", ["0", "1"])
def test_check_runs_with_the_tier(tiny_model, capsys, asynchronous):
    """batch = solo with a round after every window, its copies in line or on the helper thread (a cached
    expert and a miss give the same bits, so which window sees a swap does not matter)."""
    assert check_main(["--model", str(tiny_model), "--device", "cpu", "--slots", "2", "--max-new", "4",
                       "--expert-cache", "12", "--adapt-every", "1", "--adapt-async", asynchronous]) == 0
    assert "expert tier (simulated, 12 of 32 experts cached)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        check_main(["--model", str(tiny_model), "--device", "cpu", "--expert-cache", "lots"])
    assert "--expert-cache must be 'auto' or a number" in capsys.readouterr().err


def test_the_gpu_tier_plans_vram_per_stage(tiny_model, monkeypatch):
    """On a split each GPU holds its own layers' slots and staging: planned before loading (the batch slots
    are fitted beside them) and, for `auto`, sized from each card's free VRAM."""
    from engine.gguf_file import GGUFFile
    from engine.memory import MIB
    from engine.placement import plan_stages
    from engine.tier import flags, sizing

    g = GGUFFile(str(tiny_model))
    cuda = torch.device("cuda")
    split = plan_stages("1", 4, cuda, visible=2)  # layer 0 on the first card, layers 1-3 on the second
    per_layer = sizing.slot_bytes(g, 4, 8)
    args = build_parser().parse_args(["--model", "x.gguf", "--expert-cache", "8"])  # 2 slots in each layer
    plan = flags.plan_tier(args, g, split)
    staging = 8 * per_layer[0]  # every layer's experts take the same bytes here
    assert plan.host_experts and plan.taken == {"cuda:0": staging + 2 * per_layer[0],
                                                "cuda:1": staging + 6 * per_layer[0]}
    assert flags.plan_tier(args, g, plan_stages("", 4, torch.device("cpu"))) == flags.TierPlan()  # simulated

    class Placed:  # what auto_cache reads of a model
        placement, hyper = split, open_model(str(tiny_model), "cpu")[1].hyper
        w = type("W", (), {"g": g})

    free = {"cuda:0": 700 * MIB + staging + 5 * per_layer[0], "cuda:1": 700 * MIB + staging + 7 * per_layer[0]}
    monkeypatch.setattr(flags, "free_bytes", lambda d: (free[str(d)], 1 << 40))
    assert flags.auto_cache(Placed, 700) == [5, 2, 2, 2]  # whole rounds of one slot in each of the card's layers


def test_async_rounds_copy_on_a_helper_thread_and_no_window_waits(model, monkeypatch):
    """`--adapt-async 1`: a round evicts its slots at once and returns; while its copies are held up the
    windows go on (the evicted experts are misses), a round coming due meanwhile waits; the experts
    are published at the first window boundary after the copies, as the blocking tier would hold them."""
    import threading

    from engine.tier.slots import LayerSlots

    release = threading.Event()
    fill = LayerSlots.fill

    def held_fill(self, slot, expert):
        assert release.wait(30), "the test never released the copies"
        fill(self, slot, expert)

    _setup(model, "--expert-cache", "8", "--adapt-every", "2", "--adapt-min-count", "0", "--adapt-async", "1")
    monkeypatch.setattr(LayerSlots, "fill", held_fill)  # after the seeding, which copies at load
    tier = model.tier
    layer = tier.layers[0]

    def window(hot: int) -> None:
        before = tier.window_start()
        layer.routed[hot] += 10  # what a window's routing adds to the counts
        tier.window_done(before, tier.counted())

    window(3)
    window(3)  # a round is due: it plans expert 3 in place of an unrouted one of layer 0 and returns at once
    assert tier.rounds == 1 and tier.copier.busy and layer.slots.slot_of[3] == -1
    window(5)
    window(5)  # due again while the copies are held: deferred, the windows still run
    assert tier.rounds == 1 and layer.slots.slot_of[3] == -1
    release.set()
    tier.copier._round.result()  # the helper thread's copies are done now
    window(5)  # its start publishes the first round; its end runs the deferred one
    assert layer.slots.slot_of[3] >= 0 and tier.rounds == 2
    tier.settle()
    assert layer.slots.slot_of[5] >= 0 and not tier.copier.busy
    blocking = _setup(model, "--expert-cache", "8", "--adapt-every", "2", "--adapt-min-count", "0")
    assert blocking["adapt_async"] == 0 and model.tier.copier is None


def test_experts_stay_mapped_when_ram_is_short_or_asked(monkeypatch):
    """The GPU tier's routed experts: pinned copies while RAM holds them and 2 GiB beside, else (or with
    --mmap-experts) left in the file's memory map."""
    from engine.tier import flags
    from engine.weights import MAPPED

    gib = 1 << 30
    monkeypatch.setattr(flags, "free_bytes", lambda device: (10 * gib, 32 * gib))
    assert flags.host_memory(False, 8 * gib) is True
    assert flags.host_memory(False, 9 * gib) == MAPPED
    assert flags.host_memory(True, gib) == MAPPED
