"""The line grammar: every request and reply round-trips; malformed lines fail with a clear message."""

import pytest

from engine import protocol as P

REQUESTS = [
    "GEN 16 1,2,3",
    "GEN 8 temperature=0.7 top_p=0.9 top_k=40 min_p=0.05 seed=7 5,6",
    "GEN 8 repeat_penalty=1.1 presence_penalty=0.5 frequency_penalty=-0.5 repeat_last_n=-1 5,6",
    "BGEN 3 32 1,2",
    "STOP",
    "QUIT",
    "BSTOP 2",
    "BYIELD 1",
    "HOLD",
    "GO",
]

REPLIES = [
    "INFO engine=0.1.0 context=4096 batch_slots=4 device=cpu",
    "READY 4096 stop",
    "RESUME 12",
    "PP 512 2048 120.5 4249.0",
    "T 42",
    "DONE 16 6 203.0 1641.1 length 0 0 5 40 48 0 0 0 6 8",
    "BADM 2 1",
    "BT 2 17",
    "BDONE 2 31 stop 812.4",
    "YIELDED 1 512",
    "ERR something went wrong",
    'STATS {"windows":1,"rows":2.0}',
]


@pytest.mark.parametrize("line", REQUESTS)
def test_request_round_trip(line):
    assert P.format_command(P.parse_command(line)) == line


@pytest.mark.parametrize("line", REPLIES)
def test_reply_round_trip(line):
    assert P.format_reply(P.parse_reply(line)) == line


def test_done_with_fewer_optional_fields_parses():
    done = P.parse_reply("DONE 3 4 1.0 2.0 stop")
    assert done.reused == 0 and done.finish == "stop"


def test_done_fields_at_upstream_positions():
    done = P.parse_reply("DONE 16 6 203.0 1641.1 length 0 0 5 40 48 0 0 0 6 8")
    assert (done.reused, done.hits, done.lookups, done.prompt_read, done.offloaded) == (5, 40, 48, 6, 8)
    assert P.parse_reply("DONE 3 4 1.0 2.0 stop 0 0 2 7 9").offloaded == 0  # an engine that stops at lookups


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("", "empty line"),
        ("HELLO 1", "unknown command 'HELLO'"),
        ("GEN", "GEN needs"),
        ("GEN x 1,2", "max_new must be an integer"),
        ("GEN 0 1,2", "max_new must be >= 1"),
        ("GEN 4 1,a", "comma-separated integers"),
        ("GEN 4 -1", "token ids must be >= 0"),
        ("GEN 4 temp=1 1", "unknown request key"),
        ("GEN 4 temperature=hot 1", "bad value for temperature"),
        ("GEN 4 top_p=0 1", "top_p must be in (0, 1]"),
        ("GEN 4 min_p=2 1", "min_p must be in [0, 1]"),
        ("GEN 4 repeat_penalty=0 1", "repeat_penalty must be in (0, 10]"),
        ("GEN 4 presence_penalty=3 1", "presence_penalty must be in [-2, 2]"),
        ("GEN 4 frequency_penalty=-2.5 1", "frequency_penalty must be in [-2, 2]"),
        ("GEN 4 repeat_last_n=-2 1", "repeat_last_n must be >= -1"),
        ("GEN 4 repeat_last_n=1.5 1", "bad value for repeat_last_n"),
        ("BGEN x 4 1", "slot must be an integer"),
        ("BSTOP", "BSTOP needs <slot>"),
        ("STOP now", "STOP takes no arguments"),
        ("GO 1", "GO takes no arguments"),
    ],
)
def test_malformed_requests(line, message):
    with pytest.raises(P.ProtocolError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        P.parse_command(line)


def test_sampling_keys_leave_defaults_out():
    assert P.Sampling().to_keys() == []
    assert P.Sampling(top_k=500).to_keys() == [f"top_k={P.TOP_K_MAX}"]
    assert P.Sampling(repeat_penalty=1.0, repeat_last_n=64, presence_penalty=0.0).to_keys() == []


def test_unknown_reply_is_refused():
    with pytest.raises(P.ProtocolError):
        P.parse_reply("WHAT 1")
    with pytest.raises(P.ProtocolError):
        P.parse_reply("T x")
