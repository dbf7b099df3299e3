"""Decode windows queued ahead (`Runner.queue`: the next window on the device tokens of the last one, before
the host reads them) give every request the tokens it gets without them, in every scenario of the loop:
rows stopping by length or at a stop token while their next window is queued, admissions, reads between
windows, a read that gives way, next turns, a request stopped in its slot. On the CPU the windows run
one after the other, but the loop's bookkeeping is the CUDA one."""

import pytest
import torch

from engine import bench
from engine import protocol as P
from engine.check import Driver, collect, compare, sample_prompts
from engine.experts import ExpertStats
from engine.kv import KVCache
from engine.protocol import Sampling
from engine.runner import AHEAD, Row, Runner
from engine.scenarios import INTERLEAVES


@pytest.fixture(scope="module")
def driver(tiny_model_q8):
    # default mode (rows share each product): on the CPU the block kernels give each row its solo tokens,
    # so windows of several rows are queued ahead too
    return Driver.load(str(tiny_model_q8), slots=4, exact=False, prefill=16, ahead=True)


@pytest.mark.parametrize("keys", ["", "temperature=0.8 top_p=0.9 seed=7"], ids=["greedy", "sampled"])
def test_slots_equal_solo_with_windows_queued_ahead(driver, keys):
    driver.reset()
    prompts = sample_prompts(driver.model.hyper.vocab, 4, seed=3)
    assert compare(driver, prompts, max_new=12, keys=keys) == []
    assert driver.server.runner.queued_ahead > 0


@pytest.mark.parametrize("name", list(INTERLEAVES))
def test_interleaves_with_windows_queued_ahead(driver, name):
    driver.reset()
    assert INTERLEAVES[name](driver, "").failures == []
    assert driver.server.runner.queued_ahead > 0


def test_stop_token_while_the_next_window_is_queued(driver):
    """A row that draws a stop token has been fed it by the window queued ahead: its output is dropped, its
    session keeps what it keeps without look-ahead, and its next turn continues from it."""
    prompts = sample_prompts(driver.model.hyper.vocab, 3, seed=9)
    plain = Driver(driver.model, driver.stop_ids, driver.slots, exact=False, prefill=16, ahead=False)
    free = collect(plain.run([f"BGEN {i} 12 {','.join(map(str, p))}" for i, p in enumerate(prompts)])).slots
    stop = free[1][5]  # slot 1 stops at its sixth token; the others go on (or stop there too)
    streams = []
    for ahead in (False, True):
        d = Driver(driver.model, driver.stop_ids | {stop}, driver.slots, exact=False, prefill=16, ahead=ahead)
        lines = d.run([f"BGEN {i} 12 {','.join(map(str, p))}" for i, p in enumerate(prompts)])
        held = [list(s.tokens) for s in d.server.runner.sessions]
        again = d.run([f"BGEN 1 6 {','.join(map(str, prompts[1] + free[1][:6]))}"])
        streams.append((collect(lines).slots, held, collect(again).slots))
        if ahead:
            assert d.server.runner.queued_ahead > 0
    assert streams[0][0][1] == free[1][:6]
    assert streams[1] == streams[0]


def test_bench_decode_steps_queue_ahead_with_the_same_tokens(driver):
    """bench-engine's decode loop (`bench.decode_steps`) queues ahead as the engine's loop does."""
    prompts = sample_prompts(driver.model.hyper.vocab, 2, seed=11)
    held = []
    for ahead in (False, True):
        runner = Runner(driver.model, 2, exact=False, ahead=ahead)
        rows = [Row(runner.slot(i), int(runner.read(runner.slot(i), p).argmax()), Sampling(), 0)
                for i, p in enumerate(prompts)]
        rows = bench.decode_steps(runner, rows, 10)
        held.append(([r.token for r in rows], [s.tokens for s in runner.sessions]))
        assert runner.queued_ahead == (9 if ahead else 0)
    assert held[1] == held[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_windows_queued_ahead_on_cuda(tiny_model_q8):
    """On CUDA the runner queues ahead by itself (CUDA graphs replayed on device tokens): exact mode's
    one-row windows (the solo references) and bench-engine's loop give the tokens they give without."""
    driver = Driver.load(str(tiny_model_q8), slots=4, device="cuda", exact=True, prefill=16)
    assert compare(driver, sample_prompts(driver.model.hyper.vocab, 4, seed=5), max_new=16) == []
    assert driver.server.runner.queued_ahead > 0
    test_bench_decode_steps_queue_ahead_with_the_same_tokens(driver)


def test_rows_that_need_their_tokens_on_the_host_are_not_queued_ahead(driver):
    runner = Runner(driver.model, 2, exact=False, ahead=True)
    plain = [Row(runner.slot(i), 1, Sampling(), 0) for i in range(2)]
    assert runner.can_queue_ahead(plain)
    for keys in ("repeat_penalty=1.3", "logprobs=2"):
        sampling = P.parse_command(f"GEN 1 {keys} 0").sampling
        assert not runner.can_queue_ahead([plain[0], Row(runner.slot(1), 1, sampling, 0)])
    assert not Runner(driver.model, 2, exact=True, ahead=True).can_queue_ahead(plain)  # rows run apart
    assert Runner(driver.model, 2, exact=True, ahead=True).can_queue_ahead(plain[:1])
    assert not Runner(driver.model, 2, exact=False, ahead=False).can_queue_ahead(plain)


def test_ring_caches_are_told_apart():
    """A sliding-window layer's ring would lose a position to the token a stopped row was fed ahead."""
    def kv(windows):
        return KVCache(windows, sessions=1, kv_heads=1, context=64, head_dim=8, max_chunk=8, dtype=torch.float32,
                       device=torch.device("cpu"))

    assert kv((None, 16)).rings
    assert not kv((None, None)).rings
    assert not kv((None, 60)).rings  # a window whose ring holds the whole context


def test_a_row_fed_ahead_needs_the_window_before(driver):
    runner = Runner(driver.model, 2, exact=True, ahead=True)
    with pytest.raises(ValueError, match="needs that window"):
        runner.decode([Row(runner.slot(0), AHEAD, Sampling(), 0)])
    two = [Row(runner.slot(i), 1, Sampling(), 0) for i in range(2)]
    window = runner.queue(two)
    with pytest.raises(ValueError, match="cannot be queued ahead"):  # exact mode runs these rows apart
        runner.queue([Row(r.session, AHEAD, r.sampling, r.seed) for r in two], after=window)


def test_an_adapting_expert_tier_with_windows_queued_ahead(tiny_model_q8):
    """The simulated expert tier adapting (a round every 2 windows) while windows are queued ahead: the same
    tokens as without; each queued window counted once, after its tokens are read (`Runner.finish`), so
    the tier's windows and the loop's decode entries agree and the routing profile is the one without."""
    from engine.tier import AdaptPolicy, install_tier

    runs = []
    for ahead in (False, True):
        d = Driver.load(str(tiny_model_q8), slots=4, exact=False, prefill=16, ahead=ahead)
        tier = install_tier(d.model, 8, AdaptPolicy(every=2, min_count=0))
        prompts = sample_prompts(d.model.hyper.vocab, 4, seed=5)
        streams = collect(d.run([f"BGEN {i} 10 {','.join(map(str, p))}" for i, p in enumerate(prompts)]))
        served = sum(tier.window_log, ExpertStats())
        assert served == d.server.stats.experts and served.lookups > 0
        assert tier.windows == len(tier.window_log) and tier.rounds == tier.windows // 2 > 0
        assert (d.server.runner.queued_ahead > 0) == ahead
        runs.append((streams.slots, tier.profile("m").counts))
    assert all(len(s) == 10 for s in runs[0][0].values())  # no row stopped early: no window ran past a stop
    assert runs[1] == runs[0]
