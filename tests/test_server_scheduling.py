"""Batch-slot scheduling over the real engine loop (a HashLM model): sharing, yields, return to solo,
affinity, FIFO, early close."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from test_server_harness import LiveServer, chat_ids, user

from engine.hashlm import Rule
from server.metrics_schema import MetricsSnapshot

CHAT = "/v1/chat/completions"


def post(s: LiveServer, msgs, max_tokens, results: dict, key, **kw):
    r = s.client.post(CHAT, json={"messages": msgs, "max_tokens": max_tokens, **kw})  # shared pool: no setup delay
    results[key] = (time.monotonic(), r)


def start(s, msgs, max_tokens, results, key, **kw) -> threading.Thread:
    t = threading.Thread(target=post, args=(s, msgs, max_tokens, results, key), kwargs=kw)
    t.start()
    return t


def content(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def row_for(s: LiveServer, n_prompt: int) -> dict:
    rows = s.client.get("/metrics", params={"requests": "all"}).json()["requests"]
    return next(r for r in rows if r["prompt_tokens"] == n_prompt)


def test_concurrent_requests_share_slots_and_metrics_show_them(tmp_path):
    with LiveServer(tmp_path, config={"parallel": 2}, switches={"tok_s": 100}, rule=Rule(ends=False)) as s:
        st = s.client.get("/v1/status").json()
        assert st["concurrency"] == {"serving": 2, "requested": 2}
        a, b = user("first conversation"), user("second one")
        res: dict = {}
        threads = [start(s, a, 80, res, "a")]
        time.sleep(0.15)
        threads.append(start(s, b, 60, res, "b"))
        seen = None
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            snap = MetricsSnapshot.model_validate(s.metrics())
            if sum(sl.state == "decoding" for sl in snap.live.slots) == 2:
                seen = snap
                break
            time.sleep(0.02)
        for t in threads:
            t.join()
        assert seen is not None, "never saw two decoding slots"
        assert seen.live.parallel == 2 and seen.live.running == 2 and seen.live.tok_s >= 0
        assert all(sl.prompt_tokens > 0 and sl.held_tokens > 0 for sl in seen.live.slots)
        assert content(res["a"][1]) == s.expected_chat(a, 80)[0]
        assert content(res["b"][1]) == s.expected_chat(b, 60)[0]
        kinds = [(x["kind"], x["prompt"]) for x in s.admissions()]
        na, nb = len(chat_ids(a)), len(chat_ids(b))
        assert kinds[0] == ("GEN", na)  # alone: the solo path
        assert kinds[1][0] == "BGEN" and kinds[1][1] > na  # stopped, continued in a slot with what it generated
        assert kinds[2] == ("BGEN", nb)
        ra = row_for(s, na)
        assert ra["path"].startswith("solo+slot") and ra["output_tokens"] == 80
        time.sleep(0.3)
        after = MetricsSnapshot.model_validate(s.metrics())
        assert after.stats is not None and after.stats.windows > 0 and after.stats.rows >= after.stats.windows
        assert after.tier is not None and after.tier.hit_rate == 0 and after.tier.cpu_share == 1  # experts on the CPU


def test_long_prompt_yields_to_a_short_one(tmp_path):
    with LiveServer(tmp_path, config={"parallel": 2, "prefill": 64},
                    switches={"tok_s": 200, "prefill_tok_s": 3000}) as s:
        long_msgs, short_msgs = user("L" * 3000), user("short question")
        res: dict = {}
        t1 = start(s, long_msgs, 20, res, "long")
        time.sleep(0.3)
        t2 = start(s, short_msgs, 20, res, "short")
        t1.join()
        t2.join()
        assert content(res["long"][1]) == s.expected_chat(long_msgs, 20)[0]
        assert content(res["short"][1]) == s.expected_chat(short_msgs, 20)[0]
        assert res["short"][0] < res["long"][0]  # the short one finished first
        nl, ns = len(chat_ids(long_msgs)), len(chat_ids(short_msgs))
        adm = s.admissions()
        assert [(x["kind"], x["prompt"]) for x in adm[:3]] == [("GEN", nl), ("BGEN", ns), ("BGEN", nl)]
        assert adm[2]["reused"] > 0  # went on from the part it had read, in the slot it yielded to
        assert adm[2]["slot"] != adm[1]["slot"]
        assert row_for(s, nl)["yields"] == 1 and row_for(s, ns)["yields"] == 0


def test_no_yield_between_similar_lengths(tmp_path):
    with LiveServer(tmp_path, config={"parallel": 2, "prefill": 64},
                    switches={"tok_s": 200, "prefill_tok_s": 5000}) as s:
        m1, m2 = user("A" * 1500), user("B" * 1000)
        res: dict = {}
        t1 = start(s, m1, 10, res, 1)
        time.sleep(0.1)
        t2 = start(s, m2, 10, res, 2)
        t1.join()
        t2.join()
        assert content(res[1][1]) == s.expected_chat(m1, 10)[0]
        assert content(res[2][1]) == s.expected_chat(m2, 10)[0]
        assert row_for(s, len(chat_ids(m1)))["yields"] == 0
        assert s.admissions()[0]["prompt"] == len(chat_ids(m1))
        assert all(x["reused"] == 0 or x["prompt"] != len(chat_ids(m1)) for x in s.admissions())


@pytest.mark.parametrize("solo", ["1", "0"])
def test_return_to_the_solo_path(tmp_path, solo):
    with LiveServer(tmp_path, config={"parallel": 2}, switches={"tok_s": 150}, rule=Rule(ends=False),
                    env={"STRATA_PARALLEL_SOLO": solo}) as s:
        a, b = user("the long answer"), user("quick")
        res: dict = {}
        t1 = start(s, a, 120, res, "a")
        time.sleep(0.1)
        t2 = start(s, b, 10, res, "b")
        t1.join()
        t2.join()
        assert content(res["a"][1]) == s.expected_chat(a, 120)[0]
        assert content(res["b"][1]) == s.expected_chat(b, 10)[0]
        na = len(chat_ids(a))
        gens = [x for x in s.admissions() if x["kind"] == "GEN"]
        ra = row_for(s, na)
        if solo == "1":
            assert len(gens) == 2 and gens[1]["prompt"] > na  # back on the solo path with everything
            assert ra["returns_to_solo"] == 1 and ra["path"] == "solo+slot"
        else:
            assert len(gens) == 1 and ra["returns_to_solo"] == 0


def test_next_turn_returns_to_its_slot(tmp_path):
    with LiveServer(tmp_path, config={"parallel": 4}, switches={"tok_s": 200}, rule=Rule(ends=False),
                    env={"STRATA_PARALLEL_SOLO": "0"}) as s:
        convs = [user("conversation one " + "x" * 100 * i) for i in range(3)]
        res: dict = {}
        threads = []
        for i, c in enumerate(convs):
            threads.append(start(s, c, 30, res, i))
            time.sleep(0.05)
        for t in threads:
            t.join()
        first = {}
        for x in s.admissions():
            for i, c in enumerate(convs):
                if x["kind"] == "BGEN" and 0 <= x["prompt"] - len(chat_ids(c)) < 50:
                    first[i] = x["slot"]
        assert len(set(first.values())) == 3
        n_before = len(s.admissions())
        turn2 = [c + [{"role": "assistant", "content": content(res[i][1])}, {"role": "user", "content": "and?"}]
                 for i, c in enumerate(convs)]
        res2: dict = {}
        threads = []
        for i in (2, 0, 1):
            threads.append(start(s, turn2[i], 20, res2, i))
            time.sleep(0.05)
        for t in threads:
            t.join()
        for i in range(3):
            assert content(res2[i][1]) == s.expected_chat(turn2[i], 20)[0]
        later = s.admissions()[n_before:]
        for x in later:
            if x["kind"] != "BGEN":
                continue
            i = next(i for i in range(3) if 0 <= x["prompt"] - len(chat_ids(turn2[i])) < 50)
            assert x["slot"] == first[i], (i, x, first)
            assert x["reused"] >= len(chat_ids(convs[i]))  # the engine re-used what the slot held


def test_more_requests_than_slots_complete_in_order(tmp_path):
    with LiveServer(tmp_path, config={"parallel": 2}, switches={"tok_s": 200}, rule=Rule(ends=False)) as s:
        msgs = [user("r" * (10 + 100 * i)) for i in range(6)]
        res: dict = {}
        threads = []
        for i, m in enumerate(msgs):
            threads.append(start(s, m, 60, res, i))
            time.sleep(0.04)
        waited = 0
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and not waited:
            waited = s.metrics()["live"]["waiting_for_slot"]
        for t in threads:
            t.join()
        for i, m in enumerate(msgs):
            assert content(res[i][1]) == s.expected_chat(m, 60)[0]
        assert waited >= 1
        order = []
        for x in s.admissions():
            i = next(i for i, m in enumerate(msgs) if 0 <= x["prompt"] - len(chat_ids(m)) < 100)
            if i not in order:
                order.append(i)
        assert order == list(range(6)), (order, [(x["kind"], x["prompt"], x["slot"]) for x in s.admissions()],
                                          [len(chat_ids(m)) for m in msgs], [res[i][0] for i in range(6)])


def test_64_clients_on_4_slots_all_complete_and_correct(tmp_path):
    with LiveServer(tmp_path, config={"parallel": 4}) as s:
        msgs = [user(f"client {i} asks something {i * 7}") for i in range(64)]

        async def one(client: httpx.AsyncClient, i: int) -> str:
            body = {"messages": msgs[i], "max_tokens": 40, "stream": i % 2 == 0}
            if i % 2:
                r = await client.post(CHAT, json=body)
                return content(r)
            parts = []
            async with client.stream("POST", CHAT, json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        ch = json.loads(line[6:])
                        if ch["choices"]:
                            parts.append(ch["choices"][0]["delta"].get("content", ""))
            return "".join(parts)

        async def run() -> list[str]:
            limits = httpx.Limits(max_connections=100)
            async with httpx.AsyncClient(base_url=s.base, timeout=60, limits=limits) as c:
                return await asyncio.gather(*(one(c, i) for i in range(64)))

        got = asyncio.run(run())
        for i in range(64):
            assert got[i] == s.expected_chat(msgs[i], 40)[0], i
        m = s.metrics()
        assert m["totals"]["requests"] == 64 and m["totals"]["errors"] == 0
        assert {sl["state"] for sl in m["live"]["slots"]} == {"idle"}


def _read_a_little_then_close(s: LiveServer, msgs, chunks: int = 3) -> None:
    body = {"messages": msgs, "max_tokens": 3000, "stream": True}
    with httpx.stream("POST", s.base + CHAT, json=body, timeout=30) as r:
        n = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                n += 1
                if n > chunks:
                    break


@pytest.mark.parametrize("parallel", [1, 2])
def test_early_close_leaves_no_tokens_to_the_next_request(tmp_path, parallel):
    with LiveServer(tmp_path, config={"parallel": parallel}, switches={"tok_s": 300}, rule=Rule(ends=False)) as s:
        gone = user("I will hang up")
        _read_a_little_then_close(s, gone)  # alone
        nxt = user("next request")
        assert content(httpx.post(s.base + CHAT, json={"messages": nxt, "max_tokens": 30}, timeout=30)) == \
            s.expected_chat(nxt, 30)[0]
        # with a second request running beside it
        other = user("a request that keeps going")
        res: dict = {}
        t = start(s, other, 150, res, "other")
        time.sleep(0.1)
        _read_a_little_then_close(s, gone)
        t.join()
        assert content(res["other"][1]) == s.expected_chat(other, 150)[0]
        third = user("third")
        assert content(httpx.post(s.base + CHAT, json={"messages": third, "max_tokens": 30}, timeout=30)) == \
            s.expected_chat(third, 30)[0]
        time.sleep(0.2)
        rows = s.client.get("/metrics", params={"requests": "all"}).json()["requests"]
        dropped = [r for r in rows if r["prompt_tokens"] == len(chat_ids(gone))]
        assert len(dropped) == 2 and all(r["finish"] == "disconnect" and r["output_tokens"] < 3000 for r in dropped)


def test_non_stream_client_gone_stops_the_request(tmp_path):
    with LiveServer(tmp_path, switches={"tok_s": 200}, rule=Rule(ends=False)) as s:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.base + CHAT, json={"messages": user("slow"), "max_tokens": 3000}, timeout=0.5)
        time.sleep(0.5)
        rows = s.metrics()["requests"]
        assert rows[0]["finish"] == "disconnect" and rows[0]["output_tokens"] < 3000
        assert s.metrics()["live"]["running"] == 0


def test_admissions_sent_together_are_read_together(tmp_path):
    """Outside exact mode the server sends admissions while another reads (pipelined) and the engine reads them
    in shared forwards; each reply still follows the rule."""
    with LiveServer(tmp_path, config={"parallel": 4, "prefill": 64}, switches={"tok_s": 200, "prefill_tok_s": 4000},
                    rule=Rule(ends=False)) as s:
        first = user("the first request, alone for a moment")
        others = [user(f"request {i}: " + "x" * 400) for i in range(3)]
        res: dict = {}
        threads = [start(s, first, 60, res, "first")]
        time.sleep(0.2)
        threads += [start(s, m, 20, res, i) for i, m in enumerate(others)]
        for t in threads:
            t.join()
        assert content(res["first"][1]) == s.expected_chat(first, 60)[0]
        for i, m in enumerate(others):
            assert content(res[i][1]) == s.expected_chat(m, 20)[0]
        reads = [(x["kind"], x["prompt"], x["reading"]) for x in s.admissions()]
        assert max(x["reading"] for x in s.admissions()) >= 2, reads  # a read started beside another


def test_a_client_gone_while_its_admission_waits_behind_another_read(tmp_path):
    """A request whose admission was sent behind a long read is stopped (BSTOP) when its client leaves; the
    long read's reply and the next request's are unaffected."""
    with LiveServer(tmp_path, config={"parallel": 3, "prefill": 64}, switches={"tok_s": 200, "prefill_tok_s": 3000},
                    rule=Rule(ends=False)) as s:
        busy, long_msgs, gone = user("keeps a slot busy"), user("L" * 3000), user("G" * 2000)  # no yield: similar
        res: dict = {}
        threads = [start(s, busy, 200, res, "busy")]
        time.sleep(0.2)
        threads.append(start(s, long_msgs, 10, res, "long"))
        time.sleep(0.1)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.base + CHAT, json={"messages": gone, "max_tokens": 50}, timeout=0.3)
        for t in threads:
            t.join()
        assert content(res["busy"][1]) == s.expected_chat(busy, 200)[0]
        assert content(res["long"][1]) == s.expected_chat(long_msgs, 10)[0]
        nxt = user("next")
        assert content(httpx.post(s.base + CHAT, json={"messages": nxt, "max_tokens": 20}, timeout=30)) == \
            s.expected_chat(nxt, 20)[0]
        time.sleep(0.2)
        row = row_for(s, len(chat_ids(gone)))
        assert row["finish"] == "disconnect" and row["output_tokens"] == 0
        assert s.metrics()["live"]["running"] == 0
        assert any(x["prompt"] == len(chat_ids(gone)) and x["reading"] >= 2 for x in s.admissions())


def test_a_long_admission_yields_to_a_short_one_sent_behind_it(tmp_path):
    """Pipelined: a short prompt sent behind a long admission's read would wait for all of it (the engine reads
    admissions in the order sent), so the long read gives way as a solo read does."""
    with LiveServer(tmp_path, config={"parallel": 3, "prefill": 64},
                    switches={"tok_s": 200, "prefill_tok_s": 3000}, rule=Rule(ends=False)) as s:
        busy, long_msgs, short_msgs = user("keeps a slot busy"), user("L" * 3000), user("short question")
        res: dict = {}
        threads = [start(s, busy, 150, res, "busy")]
        time.sleep(0.2)
        threads.append(start(s, long_msgs, 20, res, "long"))
        time.sleep(0.3)
        threads.append(start(s, short_msgs, 20, res, "short"))
        for t in threads:
            t.join()
        for key, msgs, n in (("busy", busy, 150), ("long", long_msgs, 20), ("short", short_msgs, 20)):
            assert content(res[key][1]) == s.expected_chat(msgs, n)[0]
        assert res["short"][0] < res["long"][0]  # the short one finished first
        assert row_for(s, len(chat_ids(long_msgs)))["yields"] == 1
        assert row_for(s, len(chat_ids(short_msgs)))["yields"] == 0
