"""Tailing the server's and the engine's log files into one bounded buffer (no Textual)."""

from __future__ import annotations

import os
import re
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

STAMP = re.compile(r"(\d\d:\d\d:\d\d) (.*)", re.S)  # the server stamps the lines it writes (HH:MM:SS)
NARRATION = "[strata] "
ENGINE_ECHO = NARRATION + "engine: "  # the server repeats the engine's start-up lines; its own log has them


@dataclass(frozen=True)
class LogLine:
    seq: int
    source: str  # "server" | "engine" | "desk"
    text: str
    time: str = ""  # HH:MM:SS as written in the file ("" for a line without), or when the dashboard said it


class LogBuffer:
    """The last `size` lines of every source, each with a rising sequence number and its time."""

    def __init__(self, size: int = 5000) -> None:
        self.lines: deque[LogLine] = deque(maxlen=size)
        self.seq = 0

    def add(self, source: str, text: str) -> None:
        """A line of `source`; "desk" lines (the dashboard's own) are stamped now. The server's
        repeats of engine lines are dropped."""
        text = text.rstrip("\n")
        match = STAMP.fullmatch(text)
        at, text = match.groups() if match else (time.strftime("%H:%M:%S") if source == "desk" else "", text)
        if source == "server":
            if text.startswith(ENGINE_ECHO):
                return
            text = text.removeprefix(NARRATION)
        self.seq += 1
        self.lines.append(LogLine(self.seq, source, text, at))

    def since(self, seq: int) -> list[LogLine]:
        if not self.lines or self.lines[-1].seq <= seq:
            return []
        return [line for line in self.lines if line.seq > seq]


class FileTail:
    """Reads the lines appended to a file since the last call (copes with truncation/rotation)."""

    def __init__(self, path: str | Path, source: str, *, from_end_bytes: int = 16384) -> None:
        self.path = Path(path)
        self.source = source
        self.from_end_bytes = from_end_bytes
        self._pos: int | None = None
        self._inode: int | None = None
        self._partial = ""

    def read(self) -> list[str]:
        try:
            st = os.stat(self.path)
        except OSError:
            return []
        if self._inode is not None and (st.st_ino != self._inode or st.st_size < (self._pos or 0)):
            self._pos = 0  # rotated or truncated: start over
            self._partial = ""
        self._inode = st.st_ino
        if self._pos is None:
            self._pos = max(0, st.st_size - self.from_end_bytes)
            skip_first = self._pos > 0
        else:
            skip_first = False
        if st.st_size == self._pos:
            return []
        with open(self.path, "rb") as fh:
            fh.seek(self._pos)
            data = fh.read(1 << 20)
            self._pos = fh.tell()
        text = self._partial + data.decode("utf-8", errors="replace")
        lines = text.split("\n")
        self._partial = lines.pop()
        if skip_first and lines:
            lines = lines[1:]
        return lines
