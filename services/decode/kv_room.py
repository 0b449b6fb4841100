"""Remote-KV reservations that wait for room in a decode worker's KV cache.

A disaggregated request starts on its decode worker by reserving the blocks its prompt's KV
will land in (LLMEngine.remote.reserve). The gateway releases a request only when the decode
workers' last polled free blocks hold it (services/gateway/admission/capacity.py), but that
poll is up to a second old: a reservation can meet a cache that is full for a moment, until
the running requests' next finish. It waits here for blocks to free, as a request waits in
vLLM's queue, instead of failing with RESOURCE_EXHAUSTED (which the gateway turned into a
503 the client had to retry).

Waiters are served in arrival order, and a new reservation queues behind them even if it
would fit: a long prompt is not starved by a stream of short ones (vLLM's waiting queue stops
at its first request that does not fit, too). A wait ends when the reservation fits, when
`wait_s` passes from its arrival, the time in line behind others included (KVCacheFull, as
before), or when the caller goes away (cancelled: nothing was reserved). Owned by the gRPC
event loop; it reads the engine loop's stats, which the engine thread refreshes after every
step, so waiting costs the engine nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from engine.llm_engine import LLMEngine
from engine.remote_prefill import KVCacheFull
from services.common.engine_loop import EngineLoop
from services.common.request_stream import RequestStream

# How often a waiter looks at the engine's free blocks (a dict read, no engine command).
POLL_S = 0.005
# A waiter tries again at least this often even if the free count looks the same: blocks can
# free and fill between two looks, and a prefix it can adopt needs fewer than the whole prompt.
RETRY_S = 0.25


class KVRoom:
    def __init__(self, engine_loop: EngineLoop, wait_s: float) -> None:
        self.engine_loop = engine_loop
        self.wait_s = wait_s
        self._turn = asyncio.Lock()  # held by the waiter at the head; others queue on it (FIFO)
        self._waiting = 0

    @property
    def waiting(self) -> int:
        """Reservations waiting for room now."""
        return self._waiting

    async def open(self, request_id: str, start: Callable[[LLMEngine], Any], blocks: int,
                   give_up: Callable[[], bool]) -> tuple[RequestStream, Any]:
        """EngineLoop.open(request_id, start) for a `start` that reserves remote KV for a
        prompt of `blocks` blocks, waiting for room while it raises KVCacheFull. `give_up()`
        is asked between tries (the worker started draining): true ends the wait with the
        last KVCacheFull, as does a prompt larger than the whole cache, at once."""
        total = self.engine_loop.stats.get("kv_blocks_total", 0)
        if blocks > total:
            raise KVCacheFull(f"{blocks} KV blocks needed, {total:.0f} in the whole cache")
        if not self._turn.locked():
            try:
                return await self.engine_loop.open(request_id, start, during_forward=True)
            except KVCacheFull:
                pass
        loop = asyncio.get_running_loop()
        began = loop.time()  # `wait_s` bounds the whole wait, in line behind others too
        self._set_waiting(+1)
        try:
            try:
                await asyncio.wait_for(self._turn.acquire(), self.wait_s)
            except TimeoutError:
                raise KVCacheFull(f"{blocks} KV blocks needed; waited {self.wait_s:.1f}s "
                                  "behind other reservations for room") from None
            try:
                return await self._wait_for_room(request_id, start, give_up, began)
            finally:
                self._turn.release()
        finally:
            self._set_waiting(-1)

    async def _wait_for_room(self, request_id, start, give_up,
                             began: float) -> tuple[RequestStream, Any]:
        loop = asyncio.get_running_loop()
        while True:
            seen = self._free_blocks()
            try:
                return await self.engine_loop.open(request_id, start, during_forward=True)
            except KVCacheFull as exc:
                waited = loop.time() - began
                if waited >= self.wait_s or give_up():
                    raise KVCacheFull(f"{exc} after waiting {waited:.1f}s for room") from None
            retry_at = min(loop.time() + RETRY_S, began + self.wait_s)
            while (self._free_blocks() == seen and loop.time() < retry_at
                   and not give_up()):
                await asyncio.sleep(POLL_S)

    def _free_blocks(self) -> float:
        return self.engine_loop.stats.get("kv_blocks_free", 0)

    def _set_waiting(self, change: int) -> None:
        self._waiting += change
        self.engine_loop.reservations_waiting = self._waiting
