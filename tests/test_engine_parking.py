"""Conversation parking on the real loop (exact mode, the tiny test model on CPU): the seed's
parking_test. A follow-up decodes the same tokens whether its conversation stayed live in its slot
or was parked in host memory and restored, also when the store was full (evicted: read again), and
a restored follow-up reads only its new tokens."""

import threading
import time

import pytest
import torch

from engine import protocol as P
from engine.check import Driver, bgen, collect, gen, sample_prompts
from engine.hyper import ring_lengths
from engine.kv import KVCache
from engine.loop import EngineLoop
from engine.memory import MIB
from engine.parking import ParkingStore, continues
from engine.runner import Runner


class ParkingDriver(Driver):
    """The test Driver with a parking store of `entries` conversations (a fresh store per reset)."""

    def __init__(self, *args, entries: int = 4, **kw):
        self.entries = entries
        super().__init__(*args, **kw)

    def _fresh(self) -> EngineLoop:
        self.parking = ParkingStore(64 * MIB, self.entries, pin=self.model.device.type == "cuda")
        return EngineLoop(Runner(self.model, self.slots, self.exact), self.stop_ids, self.prefill,
                          self.decode_share, out=self, parking=self.parking)


@pytest.fixture(scope="module")
def driver(tiny_model):
    torch.set_num_threads(1)
    return ParkingDriver.load(str(tiny_model), slots=2, exact=True, prefill=16)


def steps(driver, *commands):
    """Each command run alone, one after the other (the engine keeps its sessions between them)."""
    return [driver.run([c]) for c in commands]


def tokens_of(lines):
    streams = collect(lines)
    return streams.solo[0] if streams.solo else next(iter(streams.slots.values()))


def resumed(lines) -> int:
    return next((P.parse_reply(ln).reused for ln in lines if ln.startswith("RESUME")), 0)


@pytest.fixture(scope="module")
def talk(driver):
    """Conversation A (first turn, its reply, a follow-up) and other prompts that take its slot."""
    vocab = driver.model.hyper.vocab
    a1, x, y, new = sample_prompts(vocab, 4, seed=71, lo=30, hi=40)
    driver.reset()
    answer = tokens_of(driver.run([bgen(0, a1, 12)]))
    return a1, answer, a1 + answer + new[:8], x, y


def test_follow_up_equals_live_after_parking(driver, talk):
    a1, answer, a2, x, _ = talk
    driver.reset()
    live = steps(driver, bgen(0, a1, 12), bgen(0, a2, 16))[-1]
    driver.reset()
    parked = steps(driver, bgen(0, a1, 12), bgen(0, x, 8), bgen(1, a2, 16))[-1]
    assert tokens_of(parked) == tokens_of(live)
    # the follow-up read only its new tokens: it reused what the live follow-up reused
    assert resumed(parked) == resumed(live) == len(a1) + len(answer) - 1
    assert driver.parking.restores == 1 and driver.parking.parks == 1
    driver.parking.stats()  # its copies' time counted once they are done: on the CPU, once queued
    assert driver.parking.timed == 1 and driver.parking.restore_ms_total == driver.parking.restore_ms_last > 0
    # restored whole (the follow-up continues it): it left the store and lives in slot 1 now
    assert driver.parking.entries == []
    driver.reset()
    assert tokens_of(driver.run([gen(a2, 16)])) == tokens_of(live)  # and both equal a read from scratch


def test_solo_session_parks_too(driver, talk):
    a1, _, a2, x, _ = talk
    driver.reset()
    live = steps(driver, gen(a1, 12), gen(a2, 16))[-1]
    driver.reset()
    parked = steps(driver, gen(a1, 12), gen(x, 8), gen(a2, 16))[-1]
    assert tokens_of(parked) == tokens_of(live) and resumed(parked) == resumed(live) > len(a1)


def test_follow_up_in_a_batch_equals_solo(driver, talk):
    """Exact mode with slots: restored while another slot decodes, the follow-up keeps its tokens."""
    a1, _, a2, x, y = talk
    driver.reset()
    expected = tokens_of(driver.run([gen(a2, 16)]))
    driver.reset()
    steps(driver, bgen(0, a1, 12), bgen(0, x, 8))
    hooks = [(lambda line: line.startswith("BT 0"), [bgen(1, a2, 16)])]
    lines = driver.run([bgen(0, y, 24)], hooks)
    assert collect(lines).slots[1] == expected
    assert driver.parking.restores == 1


def test_evicted_conversation_is_read_again_with_the_same_tokens(tiny_model, talk):
    a1, _, a2, x, y = talk
    one = ParkingDriver.load(str(tiny_model), slots=2, exact=True, prefill=16, entries=1)
    live = tokens_of(steps(one, bgen(0, a1, 12), bgen(0, a2, 16))[-1])
    one.reset()
    # A parked when x takes slot 0, then x parked when y does: the store of one drops A
    lines = steps(one, bgen(0, a1, 12), bgen(0, x, 8), bgen(0, y, 8), bgen(1, a2, 16))[-1]
    assert tokens_of(lines) == live
    assert resumed(lines) == 0 and one.parking.restores == 0
    assert one.parking.evictions == 1 and [e.tokens[: len(x)] for e in one.parking.entries] == [x]
    # a store of one, full: the slot's conversation is parked while the read restores the parked one
    one.reset()
    lines = steps(one, bgen(0, a1, 12), bgen(0, x, 8), bgen(0, a2, 16))[-1]
    assert tokens_of(lines) == live and resumed(lines) > len(a1)
    assert one.parking.restores == 1 and [e.tokens[: len(x)] for e in one.parking.entries] == [x]


def test_a_shared_prefix_is_copied_and_the_conversation_stays_parked(driver, talk):
    a1, answer, _, x, _ = talk
    driver.reset()
    other = a1[:20] + x  # another conversation with A's first 20 tokens (a system prompt)
    lines = steps(driver, bgen(0, a1, 12), bgen(0, x, 8), bgen(1, other, 4))[-1]
    assert resumed(lines) == 20 and driver.parking.restores == 1
    assert [len(e.tokens) for e in driver.parking.entries] == [len(a1) + len(answer) - 1]


def test_the_turn_checkpoint_matches_without_the_reply():
    held, turn = [1, 2, 3, 4, 9, 9], 4  # a prompt of 4, its reply 9 9
    assert continues(held, turn, [1, 2, 3, 4, 7, 8])  # the client rewrote the reply: still this one
    assert continues(held, turn, [1, 2, 3, 4])  # the same prompt again
    assert not continues(held, turn, [1, 2, 3, 5])
    assert continues([1, 2], 4, [1, 2, 3, 4])  # a part read (yielded) goes on


def test_a_parked_ring_is_restored_as_it_was():
    windows = (8, None)
    kv = KVCache(windows, sessions=2, kv_heads=2, context=64, head_dim=4, max_chunk=4, dtype=torch.float32,
                 device=torch.device("cpu"))
    for t in kv.k + kv.v:
        t.copy_(torch.randn_like(t))
    assert kv.lengths == list(ring_lengths(windows, 64, 4)) and kv.lengths[0] < 40
    held = 40  # past the ring: the ring has wrapped
    ks, vs = kv.save(0, held, pin=False)
    before = [t[0].clone() for t in kv.k + kv.v]
    for t in kv.k + kv.v:
        t[0].zero_()
    kv.load(1, ks, vs, held)
    after = [t[1] for t in kv.k + kv.v]
    assert torch.equal(after[0], before[0]) and torch.equal(after[2], before[2])  # the ring, whole
    assert torch.equal(after[1][:, :held], before[1][:, :held])  # the full layer, its positions
    assert ks[0].shape[1] == kv.lengths[0] and ks[1].shape[1] == held
    short = 5  # a ring not yet wrapped keeps only what it holds
    ks, vs = kv.save(1, short, pin=False)
    assert [t.shape[1] for t in ks] == [short, short]
    for t in kv.k + kv.v:
        t[0].zero_()
    kv.load(0, ks, vs, short)
    assert all(torch.equal(t[0, :, :short], t[1, :, :short]) for t in kv.k + kv.v)


def test_room_is_made_before_the_copy_is_taken():
    """A full store drops its least recently used before the new copy is allocated: on CUDA the dropped copy's
    pinned block is handed out again instead of a new one."""
    kv = KVCache((None,), sessions=2, kv_heads=2, context=64, head_dim=4, max_chunk=4, dtype=torch.float32,
                 device=torch.device("cpu"))
    store = ParkingStore(64 * MIB, 2, pin=False)
    store.park(kv, 0, [1, 2, 3], 3)
    store.park(kv, 0, [4, 5, 6], 3)
    held_at_save, save = [], kv.save

    def spy(*args):
        held_at_save.append([e.tokens for e in store.entries])
        return save(*args)

    kv.save = spy
    store.park(kv, 1, [4, 5, 6, 7, 8], 5)  # supersedes [4, 5, 6]
    store.park(kv, 1, [9], 1)
    assert held_at_save == [[[1, 2, 3]], [[4, 5, 6, 7, 8]]]
    assert [e.tokens for e in store.entries] == [[4, 5, 6, 7, 8], [9]] and store.evictions == 1
    assert [e.bytes for e in store.entries] == [kv.saved_bytes(5), kv.saved_bytes(1)]


def park_ahead(driver) -> int:
    """What the loop does while idle, until it has nothing left to copy ahead; returns the copies taken."""
    n = 0
    while driver.server.runner.park_ahead(driver.parking):
        n += 1
    return n


def live_follow_up(driver, a1, a2) -> list[str]:
    """The follow-up's lines with its conversation live; then a fresh engine holding the first turn in slot 0."""
    driver.reset()
    live = steps(driver, bgen(0, a1, 12), bgen(0, a2, 16))[-1]
    driver.reset()
    driver.run([bgen(0, a1, 12)])
    return live


def test_a_park_copied_ahead_restores_the_live_tokens(driver, talk):
    a1, _, a2, x, _ = talk
    live = live_follow_up(driver, a1, a2)
    assert park_ahead(driver) == 1 and list(driver.parking.ready) == [0]  # the one session holding anything
    assert driver.parking.entries == [] and driver.parking.ready_bytes == driver.model.kv.saved_bytes(len(a1) + 11)
    assert park_ahead(driver) == 0  # taken once
    driver.run([bgen(0, x, 8)])
    assert driver.parking.ahead == driver.parking.parks == 1 and driver.parking.ready == {}
    parked = driver.run([bgen(1, a2, 16)])
    assert tokens_of(parked) == tokens_of(live) and resumed(parked) == resumed(live)
    assert driver.parking.restores == 1


def test_a_copy_taken_ahead_is_dropped_when_the_conversation_goes_on(driver, talk):
    a1, _, a2, _, _ = talk
    live = live_follow_up(driver, a1, a2)
    park_ahead(driver)
    assert tokens_of(driver.run([bgen(0, a2, 16)])) == tokens_of(live)
    assert driver.parking.ready == {} and driver.parking.parks == 0


def test_the_idle_loop_copies_parks_ahead(driver, talk):
    """The real loop, left idle after a request, takes the copy by itself; the next command still comes at once."""
    a1, _, _, x, _ = talk
    driver.reset()
    loop, parking = driver.server, driver.parking
    runner = threading.Thread(target=loop.run)
    loop.commands.put(bgen(0, a1, 12))
    runner.start()
    deadline = time.monotonic() + 60
    while not parking.ready and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.commands.put(bgen(0, x, 8))
    loop.commands.put(None)
    runner.join(60)
    assert not runner.is_alive()
    assert parking.ahead == parking.parks == 1 and [len(e.tokens) for e in parking.entries] == [len(a1) + 11]


def test_a_stale_copy_taken_ahead_is_not_parked_and_room_drops_it_first():
    kv = KVCache((None,), sessions=3, kv_heads=2, context=64, head_dim=4, max_chunk=4, dtype=torch.float32,
                 device=torch.device("cpu"))
    store = ParkingStore(2 * kv.saved_bytes(8), 8, pin=False)
    assert store.park_ahead(kv, 0, [1, 2, 3], 3) and not store.park_ahead(kv, 0, [1, 2, 3], 3)
    store.park(kv, 0, [1, 2, 3, 4], 4)  # the session changed since its copy: copied now
    assert store.ahead == 0 and [e.tokens for e in store.entries] == [[1, 2, 3, 4]] and store.ready == {}
    assert not store.park_ahead(kv, 1, [1, 2, 3, 4], 4)  # parked whole already
    assert store.park_ahead(kv, 1, [5] * 8, 8)
    assert not store.park_ahead(kv, 2, [6] * 8, 8)  # does not fit beside what is parked: nothing is dropped for it
    store.park(kv, 2, [6] * 8, 8)  # a park does: the copy taken ahead first, then the least recently used
    assert store.ready == {} and [e.tokens for e in store.entries] == [[1, 2, 3, 4], [6] * 8]
    assert store.evictions == 0


def test_limits_and_bad_sizes(driver, talk):
    a1, _, _, x, _ = talk
    with pytest.raises(ValueError, match=">= 0"):
        ParkingStore(-1, 4, pin=False)
    assert not ParkingStore(0, 4, pin=False).enabled and not ParkingStore(MIB, 0, pin=False).enabled
    tiny = ParkingStore(1, 4, pin=False)  # one byte: nothing fits
    driver.reset()
    driver.run([bgen(0, a1, 4)])
    tiny.park(driver.model.kv, 0, driver.server.runner.slot(0).tokens, len(a1))
    assert tiny.entries == [] and tiny.skipped == 1


def test_engine_flags(capsys):
    from engine.__main__ import build_parser

    args = build_parser().parse_args(["--model", "m.gguf"])
    assert (args.conversation_cache_mib, args.conversation_cache_slots) == (P.CONVERSATION_CACHE_MIB,
                                                                            P.CONVERSATION_CACHE_SLOTS)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model", "m.gguf", "--conversation-cache-slots", "-1"])
    assert "must be >= 0 (got -1)" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_follow_up_equals_live_after_parking_on_cuda(tiny_model):
    """On CUDA the store keeps pinned host copies: a restored follow-up decodes its live tokens."""
    cuda = ParkingDriver.load(str(tiny_model), slots=2, device="cuda", dtype="f32", exact=True, prefill=16)
    a1, x, new = sample_prompts(cuda.model.hyper.vocab, 3, seed=72, lo=30, hi=40)
    answer = tokens_of(cuda.run([bgen(0, a1, 12)]))
    a2 = a1 + answer + new[:8]
    cuda.reset()
    live = steps(cuda, bgen(0, a1, 12), bgen(0, a2, 16))[-1]
    cuda.reset()
    parked = steps(cuda, bgen(0, a1, 12), bgen(0, x, 8), bgen(1, a2, 16))[-1]
    assert tokens_of(parked) == tokens_of(live) and resumed(parked) == resumed(live)
    assert cuda.parking.restores == 1 and cuda.parking.pin
    torch.cuda.synchronize()  # the copies done: their time (CUDA events) comes into the figures
    cuda.parking.stats()
    assert cuda.parking.timed == 1 and cuda.parking.restore_ms_last > 0
    # the park copied ahead on its own stream: the same tokens
    cuda.reset()
    cuda.run([bgen(0, a1, 12)])
    assert park_ahead(cuda) == 1
    ahead = steps(cuda, bgen(0, x, 8), bgen(1, a2, 16))[-1]
    assert tokens_of(ahead) == tokens_of(live) and cuda.parking.ahead == cuda.parking.restores == 1
