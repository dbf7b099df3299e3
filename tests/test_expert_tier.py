"""The expert tier on the simulated tier (cache slots in host RAM, cached experts and misses on the CPU).

A cached expert computes bit for bit what its host copy computes; with the cache fixed and only
partly holding the experts, batch tokens equal solo tokens for 2, 4 and 8 slots; with a skewed
router a cache seeded cold (empty, or with the coldest experts) reaches 90% of the hit rate of a
profile-seeded cache within 200 windows, counted per window, and a static one seeded wrong does not.
"""

from __future__ import annotations

import pytest
import torch

from engine.check import Driver, bgen, collect, compare, gen, sample_prompts
from engine.experts import ResidentExperts, route
from engine.loading import open_model
from engine.scenarios import INTERLEAVES
from engine.tier import FIXED, AdaptPolicy, RoutingProfile, install_tier
from engine.tier.slot_linear import storage_of
from server.config import RunConfig
from server.metrics import Metrics
from strata_desk.testmodel import write_test_model

WINDOWS = 200  # the adaptation test's horizon
TRAIL = 20  # windows over which a hit rate is "reached"


@pytest.fixture(scope="module")
def skewed_model(tmp_path_factory):
    """The tiny model with a Zipf-skewed router: a few experts per layer take most entries."""
    return write_test_model(tmp_path_factory.mktemp("models") / "tiny-skewed.gguf", preset="tiny", dtype="f32",
                            router_skew=2.0)


@pytest.fixture(scope="module")
def exact_driver(skewed_model):
    torch.set_num_threads(1)
    return Driver.load(str(skewed_model), slots=8, exact=True, prefill=16)


@pytest.fixture(scope="module")
def window_driver(skewed_model):
    """Rows share each window's products (not exact mode): the adaptation tests need many windows fast."""
    torch.set_num_threads(1)
    return Driver.load(str(skewed_model), slots=8, exact=False, prefill=64)


def _run(driver: Driver, r: int, tokens: int = 41) -> None:
    """Run `r` of the adaptation workload: 4 conversations decoding together, about 40 windows."""
    prompts = sample_prompts(driver.model.hyper.vocab, 4, seed=1000 + r, lo=4, hi=8)
    driver.reset()
    driver.run([bgen(i, p, tokens) for i, p in enumerate(prompts)])


def _workload(driver: Driver, runs: int = 5) -> None:
    for r in range(runs):
        _run(driver, r)


@pytest.fixture(scope="module")
def profile(window_driver, tmp_path_factory) -> RoutingProfile:
    """The routing profile of the adaptation workload, saved and read back as --expert-profile-save/--expert-profile do."""
    tier = install_tier(window_driver.model, 0, AdaptPolicy(every=0))
    _workload(window_driver)
    path = tmp_path_factory.mktemp("profiles") / "tiny.json"
    tier.profile("tiny-skewed.gguf").save(path)
    return RoutingProfile.load(path)


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_model_q8"], ids=["f32", "q8_0"])
def test_cached_expert_equals_host_expert_bit_for_bit(request, fixture):
    _, model = open_model(str(request.getfixturevalue(fixture)), "cpu")
    b, h = model.blk[1], model.hyper
    resident: ResidentExperts = b.experts
    x = torch.randn(12, h.hidden, generator=torch.Generator().manual_seed(3))
    weights, ids = route(x, b.ffn_gate_inp, h.experts_used, normalize=True)
    host_y = resident(x, weights, ids)
    every = install_tier(model, h.layers * h.experts, AdaptPolicy(every=FIXED))
    cached_y = b.experts(x, weights, ids)
    none = install_tier(model, 0, AdaptPolicy(every=FIXED))
    miss_y = b.experts(x, weights, ids)
    assert every.cached() == every.experts_total and none.cached() == 0
    assert torch.equal(cached_y, miss_y)  # a cached expert gives its host copy's bits
    # the resident experts run a window in one C call (silu and the weighted sum rounded there)
    assert torch.allclose(cached_y, host_y, atol=1e-6, rtol=1e-5), (cached_y - host_y).abs().max()
    served_all, served_none = every.layers[1].stats(), none.layers[1].stats()
    assert served_all.vram == served_all.lookups == 12 * h.experts_used and served_all.cpu == 0
    assert served_none.cpu == served_none.lookups == 12 * h.experts_used and served_none.vram == 0
    assert served_none.cpu_us > 0
    # each slot holds a real copy of its expert's bytes (its own memory, equal contents)
    slots = every.layers[1].slots
    for slot, expert in enumerate(slots.expert_at):
        for buf, stack in zip(slots.buffers[slot], slots.host, strict=True):
            host = storage_of(stack.experts[expert])
            assert buf.untyped_storage().data_ptr() != host.untyped_storage().data_ptr() and torch.equal(buf, host)


@pytest.mark.parametrize(("n", "cached"), [(2, 8), (4, 12), (8, 16)], ids=["2-slots-25%", "4-slots-38%", "8-slots-50%"])
def test_fixed_partial_cache_batch_equals_solo(exact_driver, profile, n, cached):
    model = exact_driver.model
    tier = install_tier(model, cached, AdaptPolicy(every=FIXED), profile)
    table = [layer.slots.slot_of.clone() for layer in tier.layers]
    prompts = sample_prompts(model.hyper.vocab, n, seed=300 + n)
    assert compare(exact_driver, prompts, max_new=16) == []
    served = model.expert_stats()
    assert served.vram > 0 and served.cpu > 0 and served.vram + served.cpu == served.lookups  # hits and misses both ran
    assert tier.swaps == 0 and all(torch.equal(t, layer.slots.slot_of) for t, layer in zip(table, tier.layers, strict=True))
    assert tier.cached() == cached


def test_adapting_cache_batch_equals_solo_on_quantized_rows(tiny_model_q8, profile):
    """Q8_0 experts on the CPU compute each row on its own, so even shared windows with a cache that
    swaps between them give each row its solo tokens."""
    torch.set_num_threads(1)
    driver = Driver.load(str(tiny_model_q8), slots=4, exact=False, prefill=16)
    tier = install_tier(driver.model, 8, AdaptPolicy(every=1, min_gain=1.0))
    prompts = sample_prompts(driver.model.hyper.vocab, 4, seed=77)
    assert compare(driver, prompts, max_new=16) == []
    assert tier.swaps > 8 and tier.rounds > 0  # slots were filled, then swapped while serving


def _hit_rates(tier) -> list[float]:
    """Each window's hit rate over the trailing TRAIL windows, from the tier's per-window counts."""
    log = list(tier.window_log)
    out = []
    for i in range(len(log)):
        part = log[max(0, i - TRAIL + 1) : i + 1]
        out.append(sum(s.vram for s in part) / max(1, sum(s.lookups for s in part)))
    return out


def _coldest(profile: RoutingProfile) -> RoutingProfile:
    """A profile that ranks each layer's experts the other way round: seeds the least-routed ones."""
    return RoutingProfile("coldest", [[max(row) - c + 1 for c in row] for row in profile.counts])


def test_cold_cache_reaches_profile_hit_rate(window_driver, profile):
    model, slots = window_driver.model, 8  # 2 of 8 experts per layer: a quarter
    seeded = install_tier(model, slots, AdaptPolicy(), profile)
    _workload(window_driver, runs=3)
    target = sum(s.vram for s in seeded.window_log) / sum(s.lookups for s in seeded.window_log)
    assert target > 0.5  # the skewed router makes a quarter of the experts worth more than half the entries

    def reached(seed: RoutingProfile | None, policy: AdaptPolicy) -> int | None:
        """The window by which the trailing hit rate reached 90% of the target, if within WINDOWS."""
        tier = install_tier(model, slots, policy, seed)
        r = 0
        while len(tier.window_log) < WINDOWS:
            _run(window_driver, r)
            r += 1
            rates = _hit_rates(tier)[:WINDOWS]
            at = next((i + 1 for i, rate in enumerate(rates) if i + 1 >= TRAIL and rate >= 0.9 * target), None)
            if at is not None:
                return at
        return None

    empty = reached(None, AdaptPolicy())
    coldest = reached(_coldest(profile), AdaptPolicy())
    static_coldest = reached(_coldest(profile), AdaptPolicy(every=0))
    assert empty is not None and empty <= WINDOWS
    assert coldest is not None and coldest <= WINDOWS
    assert static_coldest is None  # without adaptation the wrong seed stays wrong


def test_tier_figures_reach_stats_and_done(window_driver, profile):
    model = window_driver.model
    tier = install_tier(model, 8, AdaptPolicy(every=2), RoutingProfile("coldest", _coldest(profile).counts))
    window_driver.reset()
    lines = window_driver.run([bgen(i, p, 12) for i, p in enumerate(sample_prompts(model.hyper.vocab, 4, seed=5))])
    assert collect(lines).slots.keys() == {0, 1, 2, 3}
    stats = window_driver.server.stats
    line = stats.snapshot(model, window_driver.slots)
    snap = line["tier"]
    assert snap["mode"] == "simulated" and snap["swaps"] == tier.swaps > 0 and snap["adapt_rounds"] == tier.rounds > 0
    assert snap["adapt_wait_ms"] == round(tier.adapt_wait_s * 1000 / tier.windows, 4) > 0
    assert snap["adapt_wait_total_ms"] == round(tier.adapt_wait_s * 1000, 3) > 0
    # the hottest experts: the largest shares of a layer's decayed counts, hottest first, cached or not
    shares = sorted(((float(c[e] / c.sum()), layer, e) for layer, c in enumerate(tier.counts)
                     for e in range(len(c)) if c[e] > 0), reverse=True)
    hot = snap["hot"]
    assert [h["share"] for h in hot] == [round(s, 4) for s, _, _ in shares[:4]]
    for h in hot:
        counts = tier.counts[h["layer"]]
        assert h["share"] == round(float(counts[h["expert"]] / counts.sum()), 4)
        assert h["cached"] == (int(tier.layers[h["layer"]].slots.slot_of[h["expert"]]) >= 0)
    assert snap["experts_cached"] == 8 and snap["experts_total"] == 32 and snap["slots"] == 8
    assert snap["device_slots"] == {}  # the simulated tier's slots are host buffers, on no GPU
    assert snap["cache_mib"] == round(8 * 3 * 32 * 64 * 4 / 2**20, 1)  # 8 slots x 3 f32 matrices of 32 x 64
    assert snap["hits"] == stats.experts.vram and snap["lookups"] == stats.experts.lookups > 0 and snap["offloaded"] == 0
    assert snap["vram"] + snap["cpu"] == pytest.approx(1) and snap["pcie"] == 0
    # the decode windows' entries are exactly the per-window counts the tier logged
    assert sum(s.lookups for s in tier.window_log) == stats.experts.lookups
    # and the server reads them as /metrics' tier
    metrics = Metrics(RunConfig(model="x.gguf"), None)
    metrics.on_stats(line)
    view = metrics._tier()
    assert view.mode == "simulated" and view.slots == 8 and view.experts_cached == 8 and view.swaps == tier.swaps
    assert view.hit_rate == round(snap["hits"] / snap["lookups"], 4) and view.vram_share + view.cpu_share == pytest.approx(1)
    assert view.cache_mib == snap["cache_mib"] and view.cpu_ms == snap["cpu_ms"] > 0
    assert view.adapt_wait_total_ms == snap["adapt_wait_total_ms"] and view.adapt_rounds == tier.rounds
    assert [(h.layer, h.expert, h.share, h.cached) for h in view.hot] == [
        (h["layer"], h["expert"], h["share"], h["cached"]) for h in hot]


def test_a_prompt_read_counts_for_the_profile_not_for_adaptation(window_driver):
    model = window_driver.model
    tier = install_tier(model, 8, AdaptPolicy(every=1))
    seeded = [list(layer.slots.expert_at) for layer in tier.layers]
    window_driver.reset()
    window_driver.run([gen(sample_prompts(model.hyper.vocab, 1, seed=8, lo=60, hi=60)[0], 1)])
    assert tier.windows == 0 and tier.rounds == 0 and [layer.slots.expert_at for layer in tier.layers] == seeded
    assert all(float(c.sum()) == 0 for c in tier.counts)
    assert sum(map(sum, tier.profile("m").counts)) == 60 * model.hyper.layers * model.hyper.experts_used


@pytest.mark.parametrize("case", sorted(INTERLEAVES))
def test_interleave_cases_with_a_fixed_partial_cache(exact_driver, profile, case):
    """The interleave cases of `strata-desk check` over a quarter of the experts cached."""
    tier = install_tier(exact_driver.model, 8, AdaptPolicy(every=FIXED), profile)
    assert INTERLEAVES[case](exact_driver, "").failures == []
    served = exact_driver.model.expert_stats()
    assert served.vram > 0 and served.cpu > 0 and tier.swaps == 0
