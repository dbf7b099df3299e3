"""Admissions sent together are read together outside exact mode (`EngineLoop._parts`): shared forwards of at
most `--prefill` tokens, the earliest admission's first; each admission's control lines stay together, in the
order the BGENs came; ERR, BSTOP and BYIELD reach the right admission. HashLM's replies are a hash of the whole
context, so a span fed into the wrong session or position changes them."""

from __future__ import annotations

import pytest
import torch
from forwards import forwards

from engine import protocol as P
from engine.check import Driver, bgen, collect, sample_prompts
from engine.hashlm import Rule, write_hashlm
from strata_desk.testmodel import write_test_model

PROMPTS = [list(b"a long first prompt, read over three chunks"), list(b"a second one, shorter"),
           list(b"third"), list(b"and a fourth of medium length")]
CONTROL = (P.Resume, P.Progress, P.Token, P.Done, P.BAdm, P.Yielded)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_hashlm(tmp_path_factory.mktemp("hashlm") / "hashlm.gguf")


@pytest.fixture(scope="module")
def driver(path):
    return Driver.load(str(path), slots=4, exact=False, prefill=16)


def groups(lines: list[str]) -> list[list[P.Reply]]:
    """The control lines, cut after each BADM: one group per admission, in the order they were written."""
    out, current = [], []
    for line in lines:
        reply = P.parse_reply(line)
        if isinstance(reply, CONTROL):
            current.append(reply)
            if isinstance(reply, P.BAdm):
                out.append(current)
                current = []
    assert current == []
    return out


def test_admissions_sent_together_share_forwards_and_follow_the_rule(driver, monkeypatch):
    driver.reset()
    seen = forwards(driver, monkeypatch)
    lines = driver.run([bgen(i, ids, 12) for i, ids in enumerate(PROMPTS)])
    got = collect(lines).slots
    assert [got[i] for i in range(4)] == [Rule().reply(ids, 12)[0] for ids in PROMPTS]
    tokens = sum(len(ids) for ids in PROMPTS)
    assert len(seen) == -(-tokens // 16)  # every forward full but the last: 7 forwards, not 9 alone
    assert max(len(parts) for parts in seen) > 1
    assert [session for parts in seen for session in parts] == sorted(session for parts in seen for session in parts)


def test_admissions_that_come_while_the_first_starts_join_its_forward(path, monkeypatch):
    """The first BGEN of a burst wakes the loop alone; the others arrive during its reuse (the host work before
    its read) and are read in the same forward, not the next one."""
    driver = Driver.load(str(path), slots=4, exact=False, prefill=128)
    seen = forwards(driver, monkeypatch)
    runner, loop = driver.server.runner, driver.server
    reuse = runner.reuse

    def arriving(*args, **kw):
        if len(seen) == 0 and loop.commands.empty():
            for i, ids in enumerate(PROMPTS[1:], start=1):
                loop.commands.put(bgen(i, ids, 6))
        return reuse(*args, **kw)

    monkeypatch.setattr(runner, "reuse", arriving)
    got = collect(driver.run([bgen(0, PROMPTS[0], 6)])).slots
    assert [got[i] for i in range(4)] == [Rule().reply(ids, 6)[0] for ids in PROMPTS]
    assert seen[0] == [0, 1, 2, 3]  # every admission's slot in the first forward


def test_admissions_that_come_during_a_forward_are_read_before_the_decoding_rows_share(path, monkeypatch):
    """Slot 0 decodes while slot 1's prompt is read; slot 2's BGEN comes during that forward. Slot 2's read comes
    right after it, before slot 0's share of windows; after slot 2's forward (no arrival), slot 0 gets its share."""
    driver = Driver.load(str(path), slots=4, exact=False, prefill=64)
    loop, runner = driver.server, driver.server.runner
    events: list[str] = []
    read_parts, decode_step = runner.read_parts, loop.decode_step

    def read(parts):
        sessions = [session.index for session, _ in parts]
        if sessions == [1] and "R[1]" not in events:
            loop.commands.put(bgen(2, PROMPTS[2], 6))  # arrives while this forward runs
        events.append(f"R{sessions}")
        return read_parts(parts)

    def window():
        events.append("W")
        decode_step()

    monkeypatch.setattr(runner, "read_parts", read)
    monkeypatch.setattr(loop, "decode_step", window)
    hook = (lambda ln: ln == "BADM 0 1", [bgen(1, PROMPTS[0], 6)])
    got = collect(driver.run([bgen(0, PROMPTS[2], 40)], [hook])).slots
    assert [got[i] for i in range(3)] == [Rule().reply(ids, n)[0] for ids, n in
                                           ((PROMPTS[2], 40), (PROMPTS[0], 6), (PROMPTS[2], 6))]
    first = events.index("R[1]")
    assert events[first + 1:first + 3] == ["R[2]", "W"], events  # no window between the reads, then the share


def test_each_admissions_control_lines_stay_together_in_command_order(driver):
    driver.reset()
    lines = driver.run([bgen(i, ids, 12) for i, ids in enumerate(PROMPTS)])
    for slot, (ids, group) in enumerate(zip(PROMPTS, groups(lines), strict=True)):
        assert group[-1] == P.BAdm(slot, True)
        assert {r.total for r in group if isinstance(r, P.Progress)} == {len(ids)}
        assert [type(r) for r in group][-3:] == [P.Token, P.Done, P.BAdm]
    # and the slots' tokens come after their admission's BADM
    for slot in range(4):
        badm = lines.index(f"BADM {slot} 1")
        assert all(i > badm for i, ln in enumerate(lines) if ln.startswith(f"BT {slot} "))


def test_a_refused_admission_errs_after_the_admissions_sent_before_it(driver):
    driver.reset()
    lines = driver.run([bgen(0, PROMPTS[0], 4), bgen(1, PROMPTS[1], 4), "BGEN 9 4 1,2", bgen(1, PROMPTS[2], 4)])
    assert [ln for ln in lines if ln.startswith("ERR")] == ["ERR slot 9 does not exist (0..3)", "ERR slot 1 is busy"]
    assert lines.index("ERR slot 9 does not exist (0..3)") > lines.index("BADM 1 1")


def test_bstop_ends_an_admission_read_behind_another(driver):
    """BSTOP of an admission still reading behind the first: it ends at the next boundary, its DONE and BADM
    after the first admission's lines; the first is read as if alone."""
    driver.reset()
    hook = (lambda ln: ln.startswith("PP"), ["BSTOP 1"])
    lines = driver.run([bgen(0, PROMPTS[0], 8), bgen(1, PROMPTS[3], 8)], [hook])
    first, second = groups(lines)
    assert first[-1] == P.BAdm(0, True)
    assert [type(r) for r in second][-2:] == [P.Done, P.BAdm] and second[-1] == P.BAdm(1, False)
    assert second[-2].finish == "cancel"
    assert collect(lines).slots[0] == Rule().reply(PROMPTS[0], 8)[0]


def test_byield_reaches_the_admission_in_its_slot(driver):
    """BYIELD 1 while admissions 0 and 1 read together: admission 1 gives way (YIELDED in its own lines),
    admission 0 reads on; sent again, admission 1 goes on from what it had read."""
    driver.reset()
    long0, long1 = PROMPTS[0], PROMPTS[3] * 3  # 43 and 87 tokens: the third forward reads 11 + 5
    hook = (lambda ln: ln.startswith("PP") and P.parse_reply(ln).total == len(long1), ["BYIELD 1"])
    lines = driver.run([bgen(0, long0, 4), bgen(1, long1, 4)], [hook])
    first, second = groups(lines)
    assert first[-1] == P.BAdm(0, True)
    yielded = [r for r in second if isinstance(r, P.Yielded)]
    assert len(yielded) == 1 and yielded[0].slot == 1 and 0 < yielded[0].tokens < len(long1)
    again = driver.run([bgen(1, long1, 4)])
    assert f"RESUME {yielded[0].tokens}" in again
    assert collect(again).slots[1] == Rule().reply(long1, 4)[0]


def test_exact_mode_reads_one_prompt_at_a_time(path, monkeypatch):
    driver = Driver.load(str(path), slots=4, exact=True, prefill=16)
    seen = forwards(driver, monkeypatch)
    got = collect(driver.run([bgen(i, ids, 6) for i, ids in enumerate(PROMPTS)])).slots
    assert [got[i] for i in range(4)] == [Rule().reply(ids, 6)[0] for ids in PROMPTS]
    assert all(len(parts) == 1 for parts in seen)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_a_shared_forward_reads_each_prompt_as_alone(tmp_path_factory, device):
    """`Runner.read_parts` over three sessions against each prompt read alone, on the small preset's Q4_K_M mix
    (on CUDA its experts in their blocks, the fused MoE kernel's GEMM): the logits agree within rounding (a
    shared forward's products take all its rows at once) and every session holds its own prompt. Rounding may
    flip a near tie of a router: on the CPU the first prompt alone (36 rows: the packed kernel) and in the shared
    forward (87 rows: slabs) route two of its rows to other experts, which moves its logits by 1.03% of their
    largest."""
    path = write_test_model(tmp_path_factory.mktemp("models") / "small-q4_k_m.gguf", preset="small",
                            dtype="q4_k_m", router_skew=1.0)
    driver = Driver.load(str(path), slots=4, device=device, exact=False, prefill=128)
    runner = driver.server.runner
    prompts = sample_prompts(driver.model.hyper.vocab, 3, seed=11)
    together = runner.read_parts([(runner.slot(i), ids) for i, ids in enumerate(prompts)]).float().cpu()
    assert [runner.slot(i).tokens for i in range(3)] == prompts
    runner.forget()
    alone = torch.cat([runner.read_parts([(runner.slot(i), ids)]) for i, ids in enumerate(prompts)]).float().cpu()
    scale = alone.abs().max()
    assert (together - alone).abs().max() <= 2e-2 * scale, ((together - alone).abs().max(), scale)
    assert together.argmax(-1).tolist() == alone.argmax(-1).tolist()
