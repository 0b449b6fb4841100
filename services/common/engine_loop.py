"""Runs an LLMEngine on its own thread and bridges it to asyncio.

The engine thread owns the engine and everything inside it. Other threads (the gRPC event
loop, kv_transfer receiver threads) never touch the engine: they enqueue commands that run on
the engine thread between steps, and receive outputs on per-request streams.
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
from services.common.core_share import CoreShare
from services.common.forward_window import ForwardWindow
from services.common.kv_handoffs import KVHandoffs
from services.common.request_stream import RequestStream, hand_over
from services.common.step_watchdog import StepWatchdog, describe_work
from services.common.token_pace import TokenPace

log = logging.getLogger(__name__)

# Outputs (one per request and step) a request may have produced but its reader not yet taken.
# A reader that keeps up holds one or two; past this many it has stopped reading, and the
# request is cut off rather than buffered without end.
DEFAULT_MAX_UNREAD_OUTPUTS = 1024
# A reservation whose KV never arrives is settled by the engine loop after this long, whatever
# the servicer's own timer does (see EngineLoop._expire_reservations).
DEFAULT_KV_RESERVATION_TTL_S = 120.0


class EngineLoop:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05, *,
                 max_unread_outputs: int = DEFAULT_MAX_UNREAD_OUTPUTS,
                 kv_reservation_ttl_s: float = DEFAULT_KV_RESERVATION_TTL_S,
                 step_timeout_s: float = 0.0) -> None:
        if max_unread_outputs < 1:
            raise ValueError("max_unread_outputs must be >= 1")
        if kv_reservation_ttl_s <= 0:
            raise ValueError("kv_reservation_ttl_s must be > 0")
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle_wait_s = idle_wait_s
        self.max_unread_outputs = max_unread_outputs
        self.kv_reservation_ttl_s = kv_reservation_ttl_s
        self._next_expiry_check = 0.0
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.pace = TokenPace()  # the streams' time per token, for the gateway's admission
        # Remote-KV reservations waiting for free blocks (set by services/decode/kv_room.py).
        self.reservations_waiting = 0
        # Refreshed by the engine thread after every step; a plain dict swapped atomically.
        self.stats: dict[str, float] = self._stats()
        self.step_seconds = 0.0
        self.healthy = True
        # (monotonic start, "step" | "command") of the engine thread's current work, or None;
        # swapped as one reference for the watchdog thread.
        self._busy: tuple[float, str] | None = None
        self.watchdog: StepWatchdog | None = None
        if step_timeout_s > 0:
            self.watchdog = StepWatchdog(  # its thread reads what this one is stuck in
                step_timeout_s, lambda: None if self._busy is None else self._busy[0],
                lambda: describe_work(self._busy, self.engine.scheduled))
        # Called (on the engine thread) if the loop dies, e.g. to stop the process.
        self.on_crash: Callable[[], None] | None = None
        # On the engine thread after each step that ran: on_step(seconds, requests, tokens).
        self.on_step: Callable[[float, int, int], None] | None = None
        # Request metrics (services/common/request_timing.py), on the engine thread:
        # on_open(request_id, monotonic arrival) once a request is added, and
        # on_outputs(outputs, open request ids) with each batch of outputs before delivery.
        self.on_open: Callable[[str, float], None] | None = None
        self.on_outputs: Callable[[list[RequestOutput], dict], None] | None = None
        # Co-located workers lending idle cores (services/common/core_share.py), set before
        # start(): each step runs on the threads it grants; a prefill worker keeps them until
        # its prompts' KV has left (services/common/kv_handoffs.py).
        self.core_share: CoreShare | None = None
        self.step_threads = 0  # threads of the latest step with a core share (0: none yet)
        self.handoffs = KVHandoffs()
        self.window = ForwardWindow()  # held by the engine thread but in its model runs
        engine.forward_window = self.window
        self._reserved_seen = 0  # engine.remote.num_reserved at the latest step

    @property
    def stalled(self) -> bool:
        """True while one step has run longer than the step timeout (the watchdog's verdict)."""
        return self.watchdog is not None and self.watchdog.stalled

    @property
    def live(self) -> bool:
        """Whether the process should be left running: the loop has not crashed and no step
        is wedged (StepWatchdog.wedged)."""
        return self.healthy and not (self.watchdog is not None and self.watchdog.wedged)

    @property
    def ready(self) -> bool:
        """Whether new work should come here: the loop runs and no step is stuck."""
        return self.healthy and not self.stalled

    def start(self) -> None:
        self._thread.start()
        if self.watchdog is not None:
            self.watchdog.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        if self.watchdog is not None:
            self.watchdog.close()
        if self.core_share is not None and not self._thread.is_alive():
            self.core_share.close()  # a stopped worker lends every thread it had

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
                out = engine.remote.receive(request_id, first_token, payload)
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
                _settle(loop, _set_exception, future, exc)
            else:
                _settle(loop, _set_result, future, result)

        self._commands.put(command)
        self._wake.set()
        return await future

    async def open(self, request_id: str, start: Callable[[LLMEngine], Any],
                   during_forward: bool = False) -> tuple[RequestStream, Any]:
        """Register a stream for `request_id`, then run start(engine) (which adds the
        request) on the engine thread, so no output can be produced before the stream
        exists. Raises whatever start raises, leaving nothing registered. `during_forward`:
        a `start` that only reserves remote KV runs at once, on this thread, if the engine
        thread is in a model run and no command waits (services/common/forward_window.py).

        Cancelled while start is queued or running, it queues an abort behind it: the command
        queue is one FIFO, so the abort runs after start whenever start runs, and the request
        is never left reserved, computed for nobody, or run to max_tokens unread."""
        stream = RequestStream(asyncio.get_running_loop(), self.max_unread_outputs)
        arrived = time.monotonic()

        def begin(engine: LLMEngine) -> Any:
            previous = self._streams.get(request_id)
            self._streams[request_id] = stream
            try:
                result = start(engine)
                if self.on_open is not None:
                    self.on_open(request_id, arrived)
                return result
            except BaseException:
                # The id may belong to a live request (start refused it as "in use").
                if previous is None:
                    self._streams.pop(request_id, None)
                else:
                    self._streams[request_id] = previous
                raise

        def undo(engine: LLMEngine) -> None:
            # Our stream is registered exactly while the request start added is live; if start
            # failed, or the request already finished, there is nothing of ours to abort.
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
                engine.abort(request_id)

        if during_forward and self._commands.empty() and not self.stalled:
            with self.window.borrowed() as engine_held:
                if engine_held:
                    result = begin(self.engine)
                    self.stats = self._stats()
                    return stream, result
        try:
            result = await self.call(begin)
        except asyncio.CancelledError:
            self.submit(undo)
            raise
        return stream, result

    # -- the engine thread --------------------------------------------------------------

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if self.on_outputs is not None:
            self.on_outputs(outputs, self._streams)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
                if out.kv is not None and self.core_share is not None:
                    self.handoffs.computed(out.kv)
            elif stream.num_unread >= stream.max_unread:
                self._cut_off(out.request_id, stream)
                continue
            by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, batch in by_loop.items():
            hand_over(loop, batch)

    def _cut_off(self, request_id: str, stream: RequestStream) -> None:
        """The reader stopped reading: free the request's blocks and end its stream."""
        log.warning("request %.80s: %d outputs unread; its reader stopped reading, aborting it",
                    request_id, stream.num_unread)
        del self._streams[request_id]
        self.engine.abort(request_id)
        stream.put(RequestOutput(
            request_id, [], finished=True, finish_reason="error",
            error=f"the reader fell {stream.num_unread} outputs behind; request aborted"))

    def _expire_reservations(self, now: float) -> None:
        """Bound waiting_for_kv on its own: a reservation older than the TTL is recomputed
        here if its stream is still open (someone reads it), and freed if not."""
        if now < self._next_expiry_check:
            return
        ttl = self.kv_reservation_ttl_s
        self._next_expiry_check = now + min(ttl / 4, 1.0)
        for rid in self.engine.scheduler.remote_kv_overdue(now - ttl):
            if rid in self._streams:
                log.warning("KV for %.80s not here after %.1fs; recomputing locally", rid, ttl)
                self.engine.remote.recompute_locally(rid)
            else:
                log.warning("reservation of %.80s unclaimed after %.1fs; freeing it", rid, ttl)
                self.engine.abort(rid)

    def _stats(self) -> dict[str, float]:
        return {**self.engine.stats(), **self.pace.snapshot(time.monotonic()),
                "reservations_waiting": self.reservations_waiting}

    def _take_cores(self) -> None:
        """Before a step: this worker's threads and those its idle peers lend. A decoder that
        reserved KV since its last step, still to come, expects the prompt's prefill worker to
        ask for the cores within milliseconds (core_share.EXPECT_ASK_S)."""
        expect_ask = self.engine.remote.awaits_prompt_since(self._reserved_seen)
        self._reserved_seen = self.engine.remote.num_reserved
        self.step_threads = self.core_share.step_threads(meanwhile=self._commands_while_waiting,
                                                         expect_ask=expect_ask)
        self.engine.set_num_threads(self.step_threads)  # every step (LLMEngine.set_num_threads)

    def _commands_while_waiting(self) -> None:
        """While the core share holds the next step back: the queued commands, on one thread
        (the peer's team has the cores), so a new request is reserved, and received KV
        written, now rather than after the wait (core_share.CoreShare.step_threads)."""
        if self._commands.empty():
            return
        self.engine.set_num_threads(1)
        self._run_commands()

    def _idle_work(self) -> bool:
        """While nothing is runnable: once, build what the first structured-output request
        would wait for (LLMEngine.warm_structured_outputs); then fault in the next slice of the
        KV pool's pages (LLMEngine.prefault_kv); neither while a co-located peer is stepping:
        this thread would take a core its team uses (one that starts meanwhile shares it for
        at most a slice). True if it did some."""
        if self.core_share is not None and self.core_share.peer_active():
            return False
        return self.engine.warm_structured_outputs() or self.engine.prefault_kv()

    def _run_commands(self) -> None:
        ran = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                if ran:
                    # What they changed (requests added, reserved, aborted) shows now, not
                    # after the next step: a prefill worker's requests come and go within one
                    # step, and its gauges read 0 through every step that computed them
                    # (queued prefill tokens, which KEDA scales prefill on, included).
                    self.stats = self._stats()
                return
            ran = True
            self._busy = (time.monotonic(), "command")
            try:
                command()
            finally:
                self._busy = None

    def _run(self) -> None:
        engine = self.engine
        self.window.hold()
        try:
            while not self._stop.is_set():
                self._run_commands()
                scheduled = False
                if engine.scheduler.waiting or engine.scheduler.running:
                    if self.core_share is not None:
                        self._take_cores()
                    rows = len(engine.scheduler.running)
                    steps_before = engine.num_steps
                    self._busy = (time.monotonic(), "step")
                    try:
                        outputs = engine.step()
                    finally:
                        self._busy = None
                    self._deliver(outputs)
                    scheduled = engine.num_steps > steps_before
                    if scheduled:
                        # The step as the engine timed it: what cost per query splits
                        # over its requests (the loop's own work around it is not).
                        self.step_seconds = engine.last_step_seconds
                        self.pace.step_done(time.monotonic(), rows,
                                            bool(engine.scheduler.running))
                        if self.on_step is not None:
                            self.on_step(self.step_seconds, *engine.last_step_size)
                if engine.scheduler.waiting_for_kv:
                    self._expire_reservations(time.monotonic())
                self.stats = self._stats()
                if self.on_outputs is not None:  # request metrics see who left without output
                    self.on_outputs([], self._streams)
                if not scheduled:
                    # Nothing runnable (idle, or every request waits for KV or blocks).
                    if self.core_share is not None:
                        if self.handoffs.hold(lambda: not self._commands.empty()  # a prompt
                                              or self._stop.is_set()):
                            continue  # the cores still held, for the new work
                        self.core_share.idle()
                    if self._idle_work():
                        continue  # a slice at a time: commands and work come first
                    self._wake.wait(self._idle_wait_s)
                    self._wake.clear()
        except Exception as exc:
            log.exception("engine loop crashed; worker is unhealthy")
            self.healthy = False
            if self.core_share is not None:
                self.core_share.idle()
            # Every open stream ends with an error instead of hanging.
            streams, self._streams = self._streams, {}
            for rid, stream in streams.items():
                stream.put(RequestOutput(rid, [], finished=True, finish_reason="error",
                                         error=f"engine failure: {exc}"))
            if self.on_crash is not None:
                self.on_crash()
        finally:
            self.window.release()


def _settle(loop: asyncio.AbstractEventLoop, setter, future: asyncio.Future, value) -> None:
    try:
        loop.call_soon_threadsafe(setter, future, value)
    except RuntimeError:
        pass  # the caller's event loop has closed: nobody waits for the answer


def _set_result(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
