"""The errors a request can end with once the scheduler has it: each class carries its HTTP status.

The route answers `status` and `code` of the class; no status is ever read from a message's text.
"""

from __future__ import annotations


class RequestFailed(Exception):
    """A request the scheduler took ended in an error; `str(exc)` is the message the client gets."""

    status = 500
    code = "engine_error"


class EngineUnavailable(RequestFailed):
    """The engine could not be started, or it stopped during the request (the next request restarts it)."""

    status = 503


class EngineRefused(RequestFailed):
    """The engine answered `ERR` to a line the server built: the server checked the request, so a bug."""


class InternalError(RequestFailed):
    """A bug in the server while it ran the request."""


class QueueFull(RequestFailed):
    """Too many requests are waiting (`queue_limit`); the client may try again."""

    status = 503
    code = "queue_full"
