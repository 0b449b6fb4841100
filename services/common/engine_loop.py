"""Runs an LLMEngine on its own thread and bridges it to asyncio.

The engine thread owns the engine and everything inside it. Other threads (the gRPC event
loop, kv_transfer receiver threads) never touch the engine: they enqueue commands that run on
the engine thread between steps, and receive outputs on per-request asyncio queues.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput

log = logging.getLogger(__name__)


class RequestStream:
    """Outputs of one request, readable from the event loop that opened it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

    async def get(self) -> RequestOutput:
        return await self.queue.get()


class EngineLoop:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle_wait_s = idle_wait_s
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        # Refreshed by the engine thread after every step; a plain dict swapped atomically.
        self.stats: dict[str, float] = engine.stats()
        self.step_seconds = 0.0
        self.healthy = True
        # Called (on the engine thread) if the loop dies, e.g. to stop the process.
        self.on_crash: Callable[[], None] | None = None
        # Called on the engine thread after each step that ran the model:
        # on_step(seconds, num_requests, num_tokens).
        self.on_step: Callable[[float, int, int], None] | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    # -- called from any thread ---------------------------------------------------------

    def submit(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Run fn(engine) on the engine thread; fire and forget (errors are logged)."""

        def command() -> None:
            try:
                fn(self.engine)
            except Exception:
                log.exception("engine command failed")

        self._commands.put(command)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        def command(engine: LLMEngine) -> None:
            engine.abort(request_id)
            self._streams.pop(request_id, None)

        self.submit(command)

    def receive_remote_kv(
        self, request_id: str, first_token: int, payload, release: Callable | None = None
    ) -> None:
        """Queue received KV for the engine thread; `release(payload)` is called once the
        payload has been copied into the cache (or dropped)."""

        def command(engine: LLMEngine) -> None:
            try:
                out = engine.receive_remote_kv(request_id, first_token, payload)
            finally:
                if release is not None:
                    release(payload)
            if out is not None:
                self._deliver([out])

        self.submit(command)

    # -- called from an event loop ------------------------------------------------------

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the engine thread and return its result (or raise its error)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def command() -> None:
            try:
                result = fn(self.engine)
            except BaseException as exc:  # handed to the caller, not swallowed
                loop.call_soon_threadsafe(_set_exception, future, exc)
            else:
                loop.call_soon_threadsafe(_set_result, future, result)

        self._commands.put(command)
        self._wake.set()
        return await future

    async def open(self, request_id: str, start: Callable[[LLMEngine], Any]) -> tuple[RequestStream, Any]:
        """Register a stream for `request_id`, then run start(engine) (which adds the
        request) on the engine thread, so no output can be produced before the stream
        exists. Raises whatever start raises, leaving nothing registered."""
        stream = RequestStream(asyncio.get_running_loop())

        def begin(engine: LLMEngine) -> Any:
            self._streams[request_id] = stream
            try:
                return start(engine)
            except BaseException:
                self._streams.pop(request_id, None)
                raise

        result = await self.call(begin)
        return stream, result

    # -- the engine thread --------------------------------------------------------------

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
            if stream is not None:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop.is_set():
                while True:
                    try:
                        command = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    command()
                scheduled = False
                if engine.scheduler.waiting or engine.scheduler.running:
                    start = time.perf_counter()
                    steps_before = engine.num_steps
                    self._deliver(engine.step())
                    scheduled = engine.num_steps > steps_before
                    if scheduled:
                        self.step_seconds = time.perf_counter() - start
                        if self.on_step is not None:
                            self.on_step(self.step_seconds, *engine.last_step_size)
                self.stats = engine.stats()
                if not scheduled:
                    # Nothing runnable (idle, or every request waits for KV or blocks).
                    self._wake.wait(self._idle_wait_s)
                    self._wake.clear()
        except Exception as exc:
            log.exception("engine loop crashed; worker is unhealthy")
            self.healthy = False
            # Every open stream ends with an error instead of hanging.
            streams, self._streams = self._streams, {}
            for rid, stream in streams.items():
                error = RequestOutput(rid, [], finished=True, finish_reason="error",
                                      error=f"engine failure: {exc}")
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
            if self.on_crash is not None:
                self.on_crash()


def _set_result(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
