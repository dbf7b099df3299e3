"""The adaptive expert tier: every routed expert in host RAM in its file format, a cache of slots
holding copies of the hottest ones, re-ranked while the engine serves.

- `slots.py`: `LayerSlots`, one layer's cache slots and its slot table (expert -> slot or -1)
- `slot_linear.py`: a slot's matrices in the host matrices' format
- `experts.py`: `TieredExperts`, the `Experts` implementation (hits from slots, misses from host)
- `policy.py`: `AdaptPolicy` and the swaps of a round (`plan_round`)
- `profile.py`: `RoutingProfile`, the routing counts file (`--expert-profile`, `--expert-profile-save`)
- `tier.py`: `Tier` (seeding, rounds, figures) and `install_tier`
- `gpu_slots.py`, `gpu_experts.py`, `loan.py`: the GPU tier (VRAM slots, misses over PCIe or on the CPU,
  prompt chunks borrowing slots for their buffers)
- `flags.py`: the engine flags, `setup_tier` (flags -> tier, INFO keys) and `finish_tier` (at quit)

Without a GPU this is the simulated tier: the slots are host buffers and both cached experts and
misses run on the CPU, so placement, adaptation and accounting run (and are tested) anywhere.
"""

from __future__ import annotations

from engine.tier.policy import FIXED, AdaptPolicy
from engine.tier.profile import ProfileError, RoutingProfile
from engine.tier.tier import Tier, TierError, install_tier, split_slots

__all__ = ["FIXED", "AdaptPolicy", "ProfileError", "RoutingProfile", "Tier", "TierError", "install_tier",
           "parse_expert_cache", "split_slots"]


def parse_expert_cache(text: str) -> str | int:
    """`--expert-cache auto|N`: "auto" or a number of slots (the total over all layers)."""
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        raise TierError(f"--expert-cache must be 'auto' or a number of slots, got {text!r}") from None
    if n < 0:
        raise TierError(f"--expert-cache must be 'auto' or a number of slots >= 0, got {n}")
    return n
