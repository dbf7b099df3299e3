"""The batch = solo scenarios, each a run against its solo reference: `strata-desk check` and the tests.

Every scenario takes a `Driver` (engine/check.py) with at least 8 slots and the sampling keys, and
returns a `Result`: one message per divergence from the solo reference, and the reply lines of the
batched run so the tests can look at the protocol too (RESUME, YIELDED, BDONE ...).

- `slots_n`: n prompts alone, then together in slots (the seed's batch_test)
- `long_read`: a long prompt admitted while two slots decode, read between their steps
- `give_way`: a long read in a slot gives way (BYIELD) after two chunks, then goes on from it
- `next_turn`: a conversation's next turn continued from its slot, the reply kept or dropped
- `stop_solo`: a request stopped in its slot, then continued on the solo path

`INTERLEAVES` names the last four; `cases` adds `slots_n` for given slot counts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.check import Driver, bgen, collect, compare, first_divergence, gen, sample_prompts


@dataclass
class Result:
    failures: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)

    def expect(self, what: str, expected: list[int], got: list[int]) -> None:
        at = first_divergence(expected, got)
        if at is not None:
            self.failures.append(f"{what}: first divergence at token {at}: solo {expected[at:at + 4]} batch {got[at:at + 4]}")


def solo(driver: Driver, ids: list[int], max_new: int, keys: str = "") -> list[int]:
    """The tokens of `ids` read and decoded alone, on a fresh engine."""
    driver.reset()
    return collect(driver.run([gen(ids, max_new, keys)])).solo[0]


def slots_n(driver: Driver, keys: str = "", n: int = 4, seed: int = 0, max_new: int = 24) -> Result:
    return Result(compare(driver, sample_prompts(driver.model.hyper.vocab, n, seed=seed), max_new, keys))


def long_read(driver: Driver, keys: str = "", seed: int = 21, length: int = 200, max_new: int = 32) -> Result:
    vocab = driver.model.hyper.vocab
    a, b, long = sample_prompts(vocab, 2, seed=seed) + sample_prompts(vocab, 1, seed=seed + 1, lo=length, hi=length)
    expected = [solo(driver, p, max_new, keys) for p in (a, b, long)]
    driver.reset()
    # the long admission arrives after the two slots have started decoding
    hooks = [(lambda line: line.startswith("BT 1"), [bgen(2, long, max_new, keys)])]
    r = Result(lines=driver.run([bgen(0, a, max_new, keys), bgen(1, b, max_new, keys)], hooks))
    got = collect(r.lines).slots
    for slot in range(3):
        r.expect(f"slot {slot}", expected[slot], got.get(slot, []))
    return r


def give_way(driver: Driver, keys: str = "", seed: int = 31, length: int = 120, max_new: int = 20) -> Result:
    vocab = driver.model.hyper.vocab
    long = sample_prompts(vocab, 1, seed=seed, lo=length, hi=length)[0]
    short = sample_prompts(vocab, 1, seed=seed + 1, lo=10, hi=10)[0]
    expected_long, expected_short = solo(driver, long, max_new, keys), solo(driver, short, max_new, keys)
    driver.reset()
    # after the long read's second chunk the server asks it to give way
    second = 2 * driver.prefill
    first = driver.run([bgen(0, long, max_new, keys)], [(lambda line: line.startswith(f"PP {second} {length}"), ["BYIELD 0"])])
    rest = driver.run([bgen(1, short, max_new, keys), bgen(0, long, max_new, keys)])
    r = Result(lines=first + rest)
    got = collect(rest).slots
    r.expect("the read that gave way", expected_long, got.get(0, []))
    r.expect("the short one", expected_short, got.get(1, []))
    return r


def next_turn(driver: Driver, keys: str = "", seed: int = 51, max_new: int = 10) -> Result:
    """Two turns on the solo path are the reference; then turn 1 in slot 0 (beside slot 1) and turn 2
    continued from that slot, once with the reply kept and once with it dropped from the history."""
    vocab = driver.model.hyper.vocab
    turn1, other = sample_prompts(vocab, 2, seed=seed)
    extra = sample_prompts(vocab, 1, seed=seed + 1, lo=6, hi=6)[0]
    first = solo(driver, turn1, max_new, keys)
    r = Result()
    for kept in (True, False):
        turn2 = turn1 + first + extra if kept else turn1 + extra
        driver.reset()
        collect(driver.run([gen(turn1, max_new, keys)]))
        expected = collect(driver.run([gen(turn2, max_new, keys)])).solo[0]
        driver.reset()
        lines = driver.run([bgen(0, turn1, max_new, keys), bgen(1, other, max_new, keys)])
        r.expect("turn 1", first, collect(lines).slots.get(0, []))
        lines = driver.run([bgen(0, turn2, max_new, keys)])
        r.lines += lines
        r.expect(f"turn 2 ({'reply kept' if kept else 'reply dropped'})", expected, collect(lines).slots.get(0, []))
    return r


def stop_solo(driver: Driver, keys: str = "", seed: int = 61, max_new: int = 30, after: int = 8) -> Result:
    vocab = driver.model.hyper.vocab
    a, b = sample_prompts(vocab, 2, seed=seed)
    expected = solo(driver, a, max_new, keys)
    driver.reset()
    seen = [0]

    def stop_now(line: str) -> bool:
        if line.startswith("BT 0"):
            seen[0] += 1
        return seen[0] == after

    lines = driver.run([bgen(0, a, max_new, keys), bgen(1, b, max_new, keys)], [(stop_now, ["BSTOP 0"])])
    part = collect(lines).slots.get(0, [])
    rest = driver.run([gen(a + part, max_new - len(part), keys)])
    r = Result(lines=lines + rest)
    r.expect("stopped in its slot, continued alone", expected, part + collect(rest).solo[0])
    return r


# the interleave cases; `check` runs `slots_n` for each slot count it is given beside these
INTERLEAVES: dict[str, Callable[[Driver, str], Result]] = {
    "long_read": long_read,
    "give_way": give_way,
    "next_turn": next_turn,
    "stop_solo": stop_solo,
}


def cases(slot_counts: list[int], max_new: int, interleave: bool = True) -> dict[str, Callable[[Driver, str], Result]]:
    """`slots_n` for each slot count (prompts seeded by the count), then the interleave cases."""
    out = {f"{n} slots": (lambda d, keys, n=n: slots_n(d, keys, n=n, seed=n, max_new=max_new)) for n in slot_counts}
    return out | (INTERLEAVES if interleave else {})
