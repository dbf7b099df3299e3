"""Log-probabilities: the protocol's `logprobs` key and `T`/`BT` fields, `sample_rows`' log-softmax of the
penalized logits (the tokens unchanged), the engine loop's lines alone and in slots. A token's bytes:
tests/test_tokenizer.py; through the server with the `openai` package: tests/test_server_api.py."""

from __future__ import annotations

import pytest
import torch

from engine import protocol as P
from engine.check import Driver, bgen, collect, gen
from engine.hashlm import write_hashlm
from engine.sampling import Draw, Pick, logprob_of, sample_rows


def test_lines_round_trip_and_the_key_is_checked():
    lp = P.Logprob(-0.25, ((7, -0.25), (3, -1.5)))
    for reply in (P.Token(7, lp), P.BToken(2, 7, lp), P.Token(7, P.Logprob(-0.25)), P.Token(7)):
        assert P.parse_reply(P.format_reply(reply)) == reply
    assert P.format_reply(P.BToken(2, 7, lp)) == "BT 2 7 -0.25 7:-0.25,3:-1.5"
    cmd = P.Gen(4, (1, 2), P.Sampling(logprobs=3))
    assert P.parse_command(P.format_command(cmd)) == cmd and "logprobs=3" in P.format_command(cmd)
    assert "logprobs" not in P.format_command(P.Gen(4, (1, 2)))  # -1, the default, is left out
    for bad in ("logprobs=21", "logprobs=-2"):
        with pytest.raises(P.ProtocolError, match="logprobs"):
            P.parse_command(f"GEN 4 {bad} 1,2")


def test_sample_rows_reports_the_penalized_log_softmax_and_keeps_the_tokens():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    penalties = P.Sampling(repeat_penalty=1.3, presence_penalty=0.4, logprobs=2)
    asked = [Draw(penalties, 0, 5, (1, 2, 2)), Draw(P.Sampling(temperature=0.8, seed=3, logprobs=0), 3, 5),
             Draw(P.Sampling(), 0, 5)]
    plain = [Draw(P.Sampling(d.sampling.temperature, seed=d.sampling.seed, repeat_penalty=d.sampling.repeat_penalty,
                             presence_penalty=d.sampling.presence_penalty), d.seed, d.position, d.recent) for d in asked]
    got = sample_rows(logits, asked)
    assert got == sample_rows(logits, plain)
    assert not isinstance(got[2], Pick) and logprob_of(got[2]) is None
    penalized = logits[0].clone()
    for token in (1, 2):  # no frequency penalty: the count does not matter
        value = penalized[token]
        penalized[token] = (value * 1.3 if value <= 0 else value / 1.3) - 0.4
    reference = torch.log_softmax(penalized, -1)
    first = logprob_of(got[0])
    assert first.value == pytest.approx(float(reference[got[0]]), abs=1e-5)
    top = torch.topk(reference, 2)
    assert [i for i, _ in first.top] == top.indices.tolist() and first.top[0][0] == got[0]  # greedy: the best
    assert [v for _, v in first.top] == pytest.approx(top.values.tolist(), abs=1e-5)
    second = logprob_of(got[1])
    assert second.top == () and second.value == pytest.approx(float(torch.log_softmax(logits[1], -1)[got[1]]), abs=1e-5)


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    return Driver.load(str(write_hashlm(tmp_path_factory.mktemp("lp") / "hashlm.gguf")), slots=2, exact=False,
                       prefill=16)


def test_every_token_line_carries_them_alone_and_in_slots(driver):
    prompts = [list(b"first prompt"), list(b"second one")]
    runs = (lambda keys: [gen(prompts[0], 12, keys)],  # alone, then in two slots at once
            lambda keys: [bgen(i, p, 12, keys) for i, p in enumerate(prompts)])
    tokens = []
    for run in runs:
        driver.reset()
        plain = collect(driver.run(run("")))
        driver.reset()
        lines = driver.run(run("logprobs=2"))
        assert collect(lines) == plain  # the same tokens
        tokens += [P.parse_reply(ln) for ln in lines if ln.split()[0] in ("T", "BT")]
    assert {type(t) for t in tokens} == {P.Token, P.BToken}
    for t in tokens:
        assert t.logprob is not None and len(t.logprob.top) == 2 and t.logprob.value <= 0
        assert t.logprob.top[0] == (t.id, t.logprob.value)  # greedy: the chosen token is the most likely
