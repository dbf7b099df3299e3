"""`--layer-split` specs, torch-free (the server's config checks them before an engine starts):
'' (no split), 'auto', or the first layer of each later stage, rising ('24', '12,24,36')."""

from __future__ import annotations

FORMAT = "expected 'auto' or the first layer of each later stage, e.g. '24' or '12,24,36'"


def parse_split(spec: str) -> list[int] | str | None:
    """None for no split, 'auto', or the stages' first layers (each >= 1, rising); ValueError naming
    what is wrong. The model's layer count is checked where it is known (engine.placement)."""
    spec = spec.strip()
    if not spec:
        return None
    if spec == "auto":
        return "auto"
    try:
        bounds = [int(part) for part in spec.split(",")]
    except ValueError:
        raise ValueError(f"--layer-split {spec!r}: {FORMAT}") from None
    for b in bounds:
        if b < 1:
            raise ValueError(f"--layer-split {spec!r}: layer {b} is out of range (a stage starts at layer 1 or later)")
    if any(b <= a for a, b in zip(bounds, bounds[1:], strict=False)):
        raise ValueError(f"--layer-split {spec!r}: the layers must rise (each stage starts after the one before)")
    return bounds
