"""A chat reply split, as it streams, into content, reasoning (`<think>...</think>`) and tool calls.

`feed(text)` takes the reply's next text and returns what can be told for sure; `finish()` returns
the rest. Text that could still be the start of a marker (`</think>`, `<tool_call>`, ...) is held
back, so a streamed reply is cut into exactly the pieces the whole reply gives. Whitespace next to
the markers is dropped (reasoning is trimmed, content starts after `</think>`'s newlines, content
before a call loses its trailing newline), as the templates add it back when they render the turn.
A call that does not parse goes out as the content it was.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from server.tool_calls import ToolCall, ToolSyntax

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Text:
    kind: Literal["content", "reasoning"]
    text: str


Piece = Text | ToolCall


def _safe_end(text: str, markers: list[str], hold_space: bool) -> int:
    """How much of `text` can be told: not a tail that may still grow into a marker, nor (with
    `hold_space`) the whitespace before it."""
    end = len(text)
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:k]):
                end = min(end, len(text) - k)
                break
    return len(text[:end].rstrip()) if hold_space else end


class ReplyParser:
    """One reply's splitter.

    syntax: the tool-call syntax to read (None: tools were not offered, calls are content).
    reasoning: the template uses `<think>` tags, so a reply that opens with one starts with reasoning.
    thinking: the prompt already opened the `<think>` block: the reply starts inside it.
    max_calls: calls kept (parallel_tool_calls false: 1); the reply after the last is dropped.
    """

    def __init__(self, syntax: ToolSyntax | None, reasoning: bool, thinking: bool, max_calls: int | None = None):
        self.syntax = syntax
        self.max_calls = max_calls
        self.mode: Literal["content", "reasoning", "call", "ignore"] = "reasoning" if thinking else "content"
        self.pending = ""
        self.opening = reasoning and not thinking  # a "<think>" may still open the reply
        self.trim = thinking  # leading whitespace of the section is dropped
        self.opened = ""  # the marker that opened the current call
        self.calls = 0
        self.content_seen = False

    def feed(self, text: str) -> list[Piece]:
        self.pending += text
        return self._run(final=False)

    def finish(self) -> list[Piece]:
        return self._run(final=True)

    def _run(self, final: bool) -> list[Piece]:
        out: list[Piece] = []
        steps = {"content": self._content, "reasoning": self._reasoning, "call": self._call}
        while self.mode != "ignore" and steps[self.mode](final, out):
            pass
        if self.mode == "ignore":
            self.pending = ""
        return out

    def _text(self, out: list[Piece], kind: Literal["content", "reasoning"], text: str) -> None:
        if text:
            out.append(Text(kind, text))
            self.content_seen |= kind == "content" and not text.isspace()

    def _trimmed(self) -> bool:
        """Drops the section's leading whitespace; False while there is nothing else yet."""
        if self.trim:
            self.pending = self.pending.lstrip()
            self.trim = not self.pending
        return bool(self.pending)

    # Each step returns True when it changed mode (run again), False when it waits for more text.

    def _reasoning(self, final: bool, out: list[Piece]) -> bool:
        if not self._trimmed():
            return False
        i = self.pending.find(THINK_CLOSE)
        if i >= 0:
            self._text(out, "reasoning", self.pending[:i].rstrip())
            self.pending = self.pending[i + len(THINK_CLOSE):]
            self.mode, self.trim = "content", True
            return True
        keep = len(self.pending.rstrip()) if final else _safe_end(self.pending, [THINK_CLOSE], hold_space=True)
        self._text(out, "reasoning", self.pending[:keep])
        self.pending = self.pending[keep:] if not final else ""
        return False

    def _content(self, final: bool, out: list[Piece]) -> bool:
        if not self._trimmed():
            return False
        if self.opening:
            head = self.pending.lstrip()
            if head.startswith(THINK_OPEN):
                self.pending = head[len(THINK_OPEN):]
                self.mode, self.opening, self.trim = "reasoning", False, True
                return True
            if not final and THINK_OPEN.startswith(head):
                return False  # whitespace or a part of "<think>" so far
            self.opening = False
        syntax = self.syntax
        if syntax is None:
            self._text(out, "content", self.pending)
            self.pending = ""
            return False
        start, marker = self.pending.find(syntax.start), syntax.start
        head = self.pending.lstrip()
        if syntax.leading_json and not self.content_seen and head.startswith("{"):
            start, marker = len(self.pending) - len(head), ""
        if start >= 0:
            self._text(out, "content", self.pending[:start].rstrip())
            self.pending = self.pending[start + len(marker):]
            self.mode, self.opened = "call", marker
            return True
        keep = len(self.pending) if final else _safe_end(self.pending, [syntax.start], hold_space=True)
        self._text(out, "content", self.pending[:keep])
        self.pending = self.pending[keep:]
        return False

    def _call(self, final: bool, out: list[Piece]) -> bool:
        assert self.syntax is not None
        end = self.syntax.end
        i = self.pending.find(end) if end else -1
        if i < 0 and not final:
            return False
        body, rest = (self.pending[:i], self.pending[i + len(end):]) if end and i >= 0 else (self.pending, "")
        calls = self.syntax.parse(body)
        self.pending, self.mode = rest, "content"
        if calls is None:  # not a call after all
            self._text(out, "content", self.opened + body + (end if end and i >= 0 else ""))
            return True
        for call in calls[: None if self.max_calls is None else self.max_calls - self.calls]:
            out.append(replace(call, index=self.calls))
            self.calls += 1
        self.trim = True
        if self.max_calls is not None and self.calls >= self.max_calls:
            self.mode = "ignore"
        return True
