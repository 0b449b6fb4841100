"""Driving real gateway processes as tenants: closed-loop clients that count what each tenant
was admitted and served, and a gateway's /metrics read back as numbers."""

from __future__ import annotations

import asyncio
import random
import re
import time
from dataclasses import dataclass, field

import httpx
from gateway_processes import admin_url

from services.gateway.admission.tenants import key_digest


def tenants_file(tmp_path, tenants: dict[str, dict]) -> str:
    """A tenants YAML where tenant NAME's key is `sk-NAME`."""
    lines = ["tenants:"]
    for name, settings in tenants.items():
        extra = "".join(f", {k}: {v}" for k, v in settings.items())
        lines.append(f"  {name}: {{api_key_sha256: '{key_digest('sk-' + name)}'{extra}}}")
    path = tmp_path / "tenants.yaml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@dataclass
class Outcome:
    sent_at: float  # monotonic
    status: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    elapsed_s: float = 0.0
    gateway: str = ""

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class ClosedLoop:
    """`clients` loops per gateway URL sending one tenant's requests back to back (pausing
    `pause_s` after a refusal) until `stop()`; outcomes accumulate in `outcomes`."""

    urls: list[str]
    model: str
    api_key: str
    prompt_len: int = 20
    max_tokens: int = 10
    clients: int = 4
    pause_s: float = 0.05
    outcomes: list[Outcome] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> ClosedLoop:
        self._client = httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=None))
        self._tasks = [asyncio.create_task(self._loop(url, i))
                       for url in self.urls for i in range(self.clients)]
        return self

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        await self._client.aclose()

    async def _loop(self, url: str, seed: int) -> None:
        rng = random.Random(seed)
        while not self._stop.is_set():
            body = {"model": self.model, "prompt": [rng.randrange(3, 700)
                                                    for _ in range(self.prompt_len)],
                    "max_tokens": self.max_tokens, "ignore_eos": True, "temperature": 0}
            sent = time.monotonic()
            try:
                response = await self._client.post(
                    f"{url}/v1/completions", json=body,
                    headers={"Authorization": f"Bearer {self.api_key}"})
            except httpx.HTTPError:
                self.outcomes.append(Outcome(sent, 0, elapsed_s=time.monotonic() - sent,
                                             gateway=url))
                await asyncio.sleep(self.pause_s)
                continue
            outcome = Outcome(sent, response.status_code, elapsed_s=time.monotonic() - sent,
                              gateway=url)
            if response.status_code == 200:
                usage = response.json()["usage"]
                outcome.prompt_tokens = usage["prompt_tokens"]
                outcome.completion_tokens = usage["completion_tokens"]
            self.outcomes.append(outcome)
            if response.status_code != 200:
                await asyncio.sleep(self.pause_s)

    def admitted_tokens(self, start: float, end: float) -> int:
        """Tokens of requests served that were sent in [start, end)."""
        return sum(o.tokens for o in self.outcomes if start <= o.sent_at < end and o.status == 200)


def metric(url: str, name: str, labels: str = "") -> float:
    """One sample of the gateway's /metrics (0 when absent)."""
    text = httpx.get(f"{admin_url(url)}/metrics", timeout=10).text
    pattern = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else "") + r" (\S+)"
    match = re.search(r"^" + pattern + r"$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0
