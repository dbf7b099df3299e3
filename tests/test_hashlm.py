"""HashLM on the real engine loop equals its rule (`Rule.reply`): alone, in batch slots, continued from
a held or copied session; a wrong cache changes the reply (so the server tests that compare replies
with the rule also check the engine's session bookkeeping); the harness's switches parse apart from
the engine's flags."""

from __future__ import annotations

import sys

import pytest

from engine import harness
from engine.check import Driver, bgen, collect, gen
from engine.hashlm import END, Rule, write_hashlm

PROMPTS = [list(b"hello there"), list(b"a" * 70), [256, *b"user\nhi", 257, 10, 256, *b"assistant\n"], [7]]


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    path = write_hashlm(tmp_path_factory.mktemp("hashlm") / "hashlm.gguf")
    return Driver.load(str(path), slots=4, exact=False, prefill=16)


def solo(driver: Driver, ids: list[int], max_new: int) -> tuple[list[int], str]:
    driver.reset()
    lines = driver.run([gen(ids, max_new)])
    finish = next(ln for ln in lines if ln.startswith("DONE")).split()[5]
    return collect(lines).solo[0], finish


def test_solo_replies_follow_the_rule(driver):
    rule = Rule()
    replies = [solo(driver, ids, 200) for ids in PROMPTS]
    assert replies == [rule.reply(ids, 200) for ids in PROMPTS]
    assert {finish for _, finish in replies} == {"stop"}  # the end token comes by itself
    assert len({tuple(tokens) for tokens, _ in replies}) == len(PROMPTS)


def test_slots_follow_the_rule_and_continue_from_held_sessions(driver):
    rule = Rule()
    driver.reset()
    got = collect(driver.run([bgen(i, ids, 40) for i, ids in enumerate(PROMPTS)])).slots
    assert [got[i] for i in range(len(PROMPTS))] == [rule.reply(ids, 40)[0] for ids in PROMPTS]
    # the next turn of slot 0's conversation, read on the solo path: copied from the slot, which holds
    # all but the reply's last token (sampled, never fed)
    turn2 = PROMPTS[0] + got[0] + list(b" and then?")
    lines = driver.run([gen(turn2, 40)])
    assert f"RESUME {len(PROMPTS[0]) + len(got[0]) - 1}" in lines
    assert collect(lines).solo[0] == rule.reply(turn2, 40)[0]


def test_a_wrong_cache_changes_the_reply(driver):
    prompt, more = PROMPTS[1], list(b" more")
    first, _ = solo(driver, prompt, 10)
    held = prompt + first[:-1]  # the reply's last token was sampled, never fed
    driver.model.kv.k[0][driver.server.runner.solo.index, 0, len(held) - 1] += 1  # the last hash held, off
    lines = driver.run([gen(prompt + first + more, 30)])
    assert f"RESUME {len(held)}" in lines
    assert collect(lines).solo[0] != Rule().reply(prompt + first + more, 30)[0]


@pytest.mark.parametrize("rule", [Rule(ends=False), Rule(text="Grüße, 世界!")], ids=["no-end", "text"])
def test_rules_from_the_file(tmp_path, rule):
    driver = Driver.load(str(write_hashlm(tmp_path / "m.gguf", rule)), slots=2, exact=False, prefill=16)
    for ids in PROMPTS:
        assert solo(driver, ids, 60) == rule.reply(ids, 60)
    if rule.text:
        assert rule.reply(PROMPTS[0], 60)[0] == [*rule.text.encode(), END]


def test_harness_switches_leave_the_engine_flags():
    cmd = harness.command(tok_s=50, prefill_tok_s=3000, admission_log="a.jsonl")
    assert cmd[:3] == [sys.executable, "-m", "engine.harness"]
    switches, rest = harness.parse([*cmd[3:], "--serve", "--model", "m.gguf", "--prefill", "64", "--batch", "2"])
    assert switches == harness.Switches(tok_s=50.0, prefill_tok_s=3000.0, admission_log="a.jsonl")
    assert rest == ["--serve", "--model", "m.gguf", "--prefill", "64", "--batch", "2"]
    with pytest.raises(TypeError):
        harness.command(tok_per_s=5)
