"""server.metrics on its own (a fake clock, stand-in scheduler): the headline rate is smooth over
bursty decoding, the per-request mean counts running requests, the solo row's elapsed time."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from server import metrics as metrics_module
from server.config import RunConfig
from server.metrics import RATE_WINDOW_S, Metrics
from server.scheduler import Job, Segment


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(metrics_module.time, "monotonic", clock)
    return clock


def make_metrics() -> Metrics:
    return Metrics(RunConfig(model="m.gguf"), None)


def test_headline_rate_is_steady_while_two_slots_decode_in_bursts(clock: Clock) -> None:
    """Two slots on a slow CPU: a window of two tokens every 1.3 s. The headline must not jump
    (a 2 s window read 1, 2, 1, 2 ... and 0 over a prompt chunk)."""
    m = make_metrics()
    true_rate = 2 / 1.3
    samples = []
    next_burst, next_sample = clock.now, clock.now + RATE_WINDOW_S + 0.05
    while len(samples) < 30:
        if next_burst <= next_sample:
            clock.now = next_burst
            m.on_tokens(2)
            next_burst += 1.3
        else:
            clock.now = next_sample
            samples.append(m.tok_s())
            next_sample += 1.0
    assert min(samples) >= 0.85 * true_rate and max(samples) <= 1.15 * true_rate, samples


def test_mean_counts_the_requests_running(clock: Clock) -> None:
    m = make_metrics()
    job = Job(list(range(10)), 100)
    job.first_token_at = clock.now - 4.0
    job.generated = list(range(21))  # 20 tokens after the first, in 4 s
    assert m.mean_decode_tok_s([job], clock.now) == pytest.approx(5.0)
    assert m.mean_decode_tok_s([], clock.now) == 0.0


def test_solo_elapsed_counts_from_its_start_not_its_arrival(clock: Clock) -> None:
    m = make_metrics()
    job = Job(list(range(10)), 100)
    job.created = clock.now - 30.0  # waited 30 s in the queue
    job.segment, job.state = Segment(None, 10, started=clock.now - 2.0), "decoding"  # a solo GEN
    job.generated = [1, 2, 3]
    sch = SimpleNamespace(running={job}, control_job=job, slots=[], waiting=[])
    sup = SimpleNamespace(ready=True, state="ready")
    live = m._live(sch, sup, clock.now)
    assert live.elapsed_s == pytest.approx(2.0) and live.generated == 3 and live.running == 1
