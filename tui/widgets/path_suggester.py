"""Completes file-system paths in an Input (directories and .gguf files)."""

from __future__ import annotations

import os
from pathlib import Path

from textual.suggester import Suggester


class PathSuggester(Suggester):
    """Suggests the first directory or `.gguf` file that completes what was typed (`~` allowed)."""

    def __init__(self, suffix: str = ".gguf") -> None:
        super().__init__(use_cache=False, case_sensitive=True)
        self.suffix = suffix

    async def get_suggestion(self, value: str) -> str | None:
        if not value:
            return None
        expanded = os.path.expanduser(value)
        folder, _, stem = expanded.rpartition(os.sep)
        base = Path(folder or (os.sep if expanded.startswith(os.sep) else "."))
        try:
            entries = sorted(os.scandir(base), key=lambda e: e.name)
        except OSError:
            return None
        for entry in entries:
            if not entry.name.startswith(stem) or entry.name == stem or entry.name.startswith("."):
                continue
            try:
                is_dir = entry.is_dir()
            except OSError:
                continue
            if is_dir or entry.name.lower().endswith(self.suffix):
                completed = value[: len(value) - len(stem)] + entry.name
                return completed + (os.sep if is_dir else "")
        return None
