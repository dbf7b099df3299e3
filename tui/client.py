"""The dashboard's HTTP client: async polling of the server's /metrics (httpx only).

The dashboard never imports server code except `server.metrics_schema`, the contract of the
JSON it reads here.
"""

from __future__ import annotations

from typing import Protocol

import httpx
from pydantic import ValidationError

from server.metrics_schema import MetricsSnapshot


class PollError(Exception):
    """The server could not be read; the message says why in words a user understands."""


class MetricsSource(Protocol):
    """Where the dashboard gets its snapshots: the HTTP client, or fixed data in tests."""

    async def fetch(self) -> MetricsSnapshot: ...

    async def aclose(self) -> None: ...


class MetricsClient:
    """Reads GET /metrics with one pooled async httpx client."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 2.0) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=timeout)

    async def fetch(self) -> MetricsSnapshot:
        try:
            response = await self._http.get("/metrics", headers={"Accept": "application/json"})
        except httpx.ConnectError:
            raise PollError(f"cannot connect to {self.base_url}") from None
        except httpx.TimeoutException:
            raise PollError(f"{self.base_url} did not answer in time") from None
        except httpx.HTTPError as exc:
            raise PollError(f"{self.base_url}: {exc}") from None
        if response.status_code == 401:
            raise PollError("the server wants an API key (attach with --key KEY)")
        if response.status_code >= 400:
            raise PollError(f"/metrics answered HTTP {response.status_code}")
        try:
            return MetricsSnapshot.model_validate_json(response.content)
        except ValidationError as exc:
            raise PollError(f"/metrics sent an unexpected shape: {exc.errors()[0]['msg']}") from None

    async def aclose(self) -> None:
        await self._http.aclose()


class FixedSource:
    """Serves given snapshots in turn (the last one repeats): snapshots, previews and tests."""

    def __init__(self, *snapshots: MetricsSnapshot, fail: str | None = None) -> None:
        self.snapshots = list(snapshots)
        self.fail = fail
        self.calls = 0

    async def fetch(self) -> MetricsSnapshot:
        self.calls += 1
        if self.fail is not None or not self.snapshots:
            raise PollError(self.fail or "no data")
        if len(self.snapshots) > 1:
            return self.snapshots.pop(0)
        return self.snapshots[0]

    async def aclose(self) -> None:
        return None

