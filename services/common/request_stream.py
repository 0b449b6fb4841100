"""RequestStream: the outputs of one request, put by the engine thread and got on the event
loop that opened it; `hand_over` puts a step's outputs for one event loop with one wake-up."""

from __future__ import annotations

import asyncio
import logging

from engine.outputs import RequestOutput

log = logging.getLogger("services.common.engine_loop")


class RequestStream:
    """Outputs of one request: the engine thread puts, the event loop that opened it gets.

    Bounded by `max_unread` outputs put but not yet got; the engine loop cuts the request off
    before it would exceed that (one final error output may follow). Each side counts only its
    own operations, so the bound needs no lock.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, max_unread: int) -> None:
        self.loop = loop
        self.max_unread = max_unread
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.num_put = 0  # engine thread
        self.num_got = 0  # event loop

    @property
    def num_unread(self) -> int:
        return self.num_put - self.num_got

    async def get(self) -> RequestOutput:
        out = await self.queue.get()
        self.num_got += 1
        return out

    def get_ready(self) -> list[RequestOutput]:
        """The outputs already queued, without waiting (a reader that fell behind catches
        up by sending them as one message)."""
        outs = []
        while not self.queue.empty():
            outs.append(self.queue.get_nowait())
        self.num_got += len(outs)
        return outs

    def put(self, out: RequestOutput) -> None:
        """Engine thread. An event loop that has closed has no reader left: drop the output."""
        hand_over(self.loop, [(self, out)])


def hand_over(loop: asyncio.AbstractEventLoop,
              batch: list[tuple[RequestStream, RequestOutput]]) -> None:
    """Engine thread: put a step's outputs for streams of one event loop onto their queues with
    one wake-up of that loop (a call_soon_threadsafe writes to the loop's self-pipe; one per
    request per step was a system call and a callback per token at batch 32)."""
    for stream, _ in batch:
        stream.num_put += 1
    try:
        loop.call_soon_threadsafe(_put_all, batch)
    except RuntimeError:
        log.debug("%d outputs dropped: their event loop is closed", len(batch))


def _put_all(batch: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, out in batch:
        stream.queue.put_nowait(out)
