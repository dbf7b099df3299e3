"""Routing profiles: how often each layer's experts were routed, as a small JSON file.

`--expert-profile-save FILE` writes the engine's routing counts (prompt chunks and decode windows,
never decayed) when it quits; `--expert-profile FILE` seeds the cache with each layer's most routed
experts. The file: `{"format": "strata-expert-profile", "version": 1, "model": NAME, "layers": L,
"experts": E, "counts": [[...E counts...] * L]}`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

FORMAT = "strata-expert-profile"
VERSION = 1


class ProfileError(ValueError):
    pass


@dataclass
class RoutingProfile:
    model: str
    counts: list[list[int]]  # [layer][expert]

    @property
    def layers(self) -> int:
        return len(self.counts)

    @property
    def experts(self) -> int:
        return len(self.counts[0]) if self.counts else 0

    def check_shape(self, layers: int, experts: int, path: str | Path = "profile") -> None:
        if (self.layers, self.experts) != (layers, experts):
            raise ProfileError(f"{path}: routing profile of {self.layers} layers x {self.experts} experts "
                               f"(model {self.model!r}) does not fit this model's {layers} x {experts}")

    def save(self, path: str | Path) -> None:
        data = {"format": FORMAT, "version": VERSION, "model": self.model, "layers": self.layers,
                "experts": self.experts, "counts": self.counts}
        tmp = Path(f"{path}.tmp")
        tmp.write_text(json.dumps(data, separators=(",", ":")) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path) -> RoutingProfile:
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ProfileError(f"cannot read routing profile {path}: {exc.strerror or exc}") from exc
        except json.JSONDecodeError as exc:
            raise ProfileError(f"{path}: not a routing profile (invalid JSON: {exc.msg})") from exc
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ProfileError(f"{path}: not a routing profile (no \"format\": \"{FORMAT}\")")
        if data.get("version") != VERSION:
            raise ProfileError(f"{path}: routing profile version {data.get('version')!r}, this engine reads {VERSION}")
        counts = data.get("counts")
        if (not isinstance(counts, list) or not counts
                or not all(isinstance(row, list) and len(row) == len(counts[0]) for row in counts)
                or not all(isinstance(c, int) and c >= 0 for row in counts for c in row)):
            raise ProfileError(f"{path}: \"counts\" must be a non-empty list of equal-length lists of counts >= 0")
        return cls(str(data.get("model", "")), counts)
