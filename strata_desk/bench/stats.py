"""Statistics for the benchmark: medians and a bootstrap interval for a ratio of medians."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

BOOTSTRAP_SEED = 20260465  # fixed, so a report is reproducible from its samples
BOOTSTRAP_N = 10000


@dataclass(frozen=True)
class RatioCI:
    ratio: float  # median(arm) / median(base)
    low: float  # the interval's bounds, same scale as ratio
    high: float
    level: float = 0.95

    @property
    def percent(self) -> str:
        """`+15.4% (95% CI +12.5% to +17.9%)`."""
        def pct(x: float) -> str:
            return f"{(x - 1) * 100:+.1f}%"
        return f"{pct(self.ratio)} ({self.level:.0%} CI {pct(self.low)} to {pct(self.high)})"

    @property
    def times(self) -> str:
        """`2.08x (95% CI 1.95x to 2.12x)`."""
        return f"{self.ratio:.2f}x ({self.level:.0%} CI {self.low:.2f}x to {self.high:.2f}x)"


def median(values: Sequence[float]) -> float:
    """The median, NaN for no values."""
    return float(np.median(np.asarray(values, dtype=float))) if len(values) else float("nan")


def bootstrap_ratio_ci(
    arm: Sequence[float],
    base: Sequence[float],
    n_boot: int = BOOTSTRAP_N,
    level: float = 0.95,
    seed: int = BOOTSTRAP_SEED,
) -> RatioCI:
    """Ratio of medians arm/base with a percentile bootstrap interval (both samples resampled
    independently with replacement, `n_boot` times, numpy's default generator with a fixed seed)."""
    a = np.asarray(arm, dtype=float)
    b = np.asarray(base, dtype=float)
    if a.size == 0 or b.size == 0:
        raise ValueError("bootstrap_ratio_ci needs at least one sample on each side")
    point = float(np.median(a) / np.median(b))
    rng = np.random.default_rng(seed)
    ma = np.median(a[rng.integers(0, a.size, size=(n_boot, a.size))], axis=1)
    mb = np.median(b[rng.integers(0, b.size, size=(n_boot, b.size))], axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = ma / mb
    ratios = ratios[np.isfinite(ratios)]
    alpha = (1 - level) / 2
    low, high = (np.quantile(ratios, [alpha, 1 - alpha]) if ratios.size else (float("nan"),) * 2)
    return RatioCI(point, float(low), float(high), level)
