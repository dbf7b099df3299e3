"""engine/window_log.py: the periodic `strata batch:` line, counted from the windows it is given."""

from engine.experts import ExpertStats
from engine.window_log import WindowLog


def test_a_line_every_period_with_the_windows_since_the_last():
    now = [0.0]
    log = WindowLog(every_s=10.0, clock=lambda: now[0])
    assert log.window(4, 0.02, ExpertStats(32, 24, 6, 2, 1500), (1, 10, 0.001)) is None
    now[0] = 10.0
    line = log.window(2, 0.01, ExpertStats(16, 16, 0, 0, 0), (3, 40, 0.004))
    assert line == ("strata batch: 2 windows, 6 rows in 30 ms = 200.0 rows/s (3.0 rows, 15.0 ms a window); "
                    "routed experts a window: 20.0 VRAM, 3.0 PCIe, 1.0 CPU (0.75 ms of CPU); "
                    "adaptation: 3 rounds, 40 swaps, 4.0 ms waited")  # since the start
    now[0] = 25.0
    line = log.window(1, 0.005, ExpertStats(8, 8, 0, 0, 0), (5, 50, 0.006))
    assert line.endswith("adaptation: 2 rounds, 10 swaps, 2.0 ms waited")  # since the last line
    now[0] = 40.0
    line = WindowLog(every_s=0.0).window(1, 0.005, ExpertStats(), None)  # a dense model: rows and time only
    assert line == "strata batch: 1 windows, 1 rows in 5 ms = 200.0 rows/s (1.0 rows, 5.0 ms a window)"
