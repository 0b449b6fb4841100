"""The hand-off between a prefill and a decode worker sharing a host's cores
(services/common/core_share.py, services/common/kv_handoffs.py): real processes sharing a real
share file, and an engine loop over a real engine.

A decoder that has just reserved KV for a prompt waits (briefly) for the prefill worker to ask
for the cores instead of starting a step the prompt would then wait out; the prefill worker
keeps its cores until its step's KV has left, so the paused decoder writes it into its cache
before its next step; and what reached the decoder during its pause's last poll is run before
that step."""

from __future__ import annotations

import asyncio
import struct
import threading
import time

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from services.common import core_share
from services.common.core_share import CoreShare
from services.common.engine_loop import EngineLoop
from tests.services.test_core_share import Peer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def share_path(tmp_path):
    return str(tmp_path / "cores")


class Stepper:
    """step_threads(expect_ask=...) of a CoreShare of this process, on a thread."""

    def __init__(self, share: CoreShare, expect_ask: bool, meanwhile=None) -> None:
        self.result: list[tuple[int, float]] = []
        self.started = time.monotonic()
        self.thread = threading.Thread(target=lambda: self.result.append(
            (share.step_threads(meanwhile=meanwhile, expect_ask=expect_ask), time.monotonic())))
        self.thread.start()

    def wait(self, timeout: float) -> tuple[int, float]:
        self.thread.join(timeout)
        assert self.result, f"step_threads did not return within {timeout} s"
        return self.result[0]


def test_a_decoder_that_reserved_waits_for_the_prefill_workers_ask_and_pauses(share_path,
                                                                            monkeypatch):
    """The ask comes 0.2 s after the decoder reached its boundary (the limit is stretched to
    2 s so that a slow machine cannot make it miss): the decoder pauses for the prompt's step
    rather than start its own, and steps on both cores once the prefill worker idles."""
    monkeypatch.setattr(core_share, "EXPECT_ASK_S", 2.0)
    prefill = Peer(share_path, prefill=True)
    decode = CoreShare(share_path, 1, borrow=True, cores=2, yield_burst_s=10.0)
    try:
        stepper = Stepper(decode, expect_ask=True)
        time.sleep(0.2)
        assert stepper.thread.is_alive(), "the decoder stepped without waiting for the ask"
        assert prefill.ask("step")[0] == 2  # the decoder paused: the prompt has both cores
        time.sleep(0.2)
        assert stepper.thread.is_alive(), "the decoder stepped while the prefill worker did"
        prefill.ask("idle")
        threads, _ = stepper.wait(5)
        assert threads == 2 and decode.yields == 1 and decode.yield_seconds >= 0.4
    finally:
        prefill.stop()
        decode.close()


def test_an_ask_that_never_comes_costs_the_wait_and_credit_only(share_path, monkeypatch):
    """No prefill worker asks: the decoder steps after EXPECT_ASK_S (here 0.3 s), the wait
    charged to its credit; without a reservation it does not wait at all."""
    monkeypatch.setattr(core_share, "EXPECT_ASK_S", 0.3)
    prefill = Peer(share_path, prefill=True)
    decode = CoreShare(share_path, 1, borrow=True, cores=2, yield_burst_s=10.0)
    try:
        start = time.monotonic()
        assert decode.step_threads() == 2
        assert time.monotonic() - start < 0.2
        credit = decode._yield_credit
        stepper = Stepper(decode, expect_ask=True)
        threads, stepped_at = stepper.wait(5)
        assert threads == 2 and 0.29 <= stepped_at - stepper.started < 2.0
        assert decode._yield_credit <= credit - 0.25
        assert decode.yields == 0  # not a pause for a prompt
    finally:
        prefill.stop()
        decode.close()


def test_unanswered_waits_stop_and_an_out_of_credit_decoder_says_so(share_path, monkeypatch):
    """Without a prefill peer on the host nothing is waited for; after EXPECT_ASK_MISSES
    unanswered waits in a row the decoder stops waiting until its next pause (its prompts go
    to prefill workers elsewhere); and a wait that spends its credit rewrites its slot, so a
    prefill worker does not wait for a pause that will not come."""
    monkeypatch.setattr(core_share, "EXPECT_ASK_S", 0.1)
    decode = CoreShare(share_path, 1, borrow=True, cores=2, yield_burst_s=10.0)
    prefill = None
    try:
        start = time.monotonic()
        decode.step_threads(expect_ask=True)  # alone on the host: no wait
        assert time.monotonic() - start < 0.05
        prefill = Peer(share_path, prefill=True)
        for _ in range(core_share.EXPECT_ASK_MISSES):
            start = time.monotonic()
            decode.step_threads(expect_ask=True)
            assert time.monotonic() - start >= 0.09
        start = time.monotonic()
        decode.step_threads(expect_ask=True)
        assert time.monotonic() - start < 0.05, "waited after three unanswered waits"
        decode._unanswered = 0
        decode._yield_credit, decode.yield_share = 0.01, 1e-6  # nothing refills it
        decode.step_threads(expect_ask=True)
        flags = struct.Struct("<qiiii")
        with open(share_path, "rb") as share:
            share.seek(decode.slot * flags.size)
            assert not flags.unpack(share.read(flags.size))[4] & core_share._WILLING
    finally:
        if prefill is not None:
            prefill.stop()
        decode.close()


def test_what_came_during_the_pauses_last_poll_runs_before_the_step(share_path):
    """The decoder's `meanwhile` (its engine loop's queued commands: received KV) runs once
    more after the prefill worker stops asking, so KV that arrived while the last poll slept
    joins the step about to start."""
    prefill = Peer(share_path, prefill=True)
    decode = CoreShare(share_path, 1, borrow=True, cores=2, yield_burst_s=10.0)
    seen: list[bool] = []
    try:
        prefill.conn.send("step")
        time.sleep(0.05)
        stepper = Stepper(decode, expect_ask=False,
                          meanwhile=lambda: seen.append(decode._asked_to_pause()))
        assert prefill.conn.poll(10) and prefill.conn.recv()[0] == 2
        time.sleep(0.1)
        prefill.ask("idle")
        stepper.wait(5)
        assert seen and seen[0] and not seen[-1], seen
    finally:
        prefill.stop()
        decode.close()


def _slot_active(path: str, slot: int) -> bool:
    layout = struct.Struct("<qiiii")  # core_share's slot: pid, own, active, borrowed, flags
    with open(path, "rb") as share:
        share.seek(slot * layout.size)
        return bool(layout.unpack(share.read(layout.size))[2])


def test_a_prefill_loop_keeps_its_cores_until_its_steps_kv_has_left(tiny_llama_dir,
                                                                     share_path):
    """A prefill engine loop (priority share) stays active after a step whose KV its caller
    still has to send, until the transfer settles; KV that never settles holds it no longer
    than the hold limit (here 0.5 s)."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32",
                                    num_kv_blocks=64, num_threads=1))
    loop = EngineLoop(engine, idle_wait_s=0.01)
    loop.core_share = CoreShare(share_path, 1, borrow=True, cores=2, priority=True)
    loop.handoffs.hold_s = 0.5
    params = SamplingParams(max_tokens=1, temperature=0.0)
    loop.start()

    async def prefill(rid: str):
        stream, _ = await loop.open(rid, lambda e: e.add_request(
            rid, list(range(5, 37)), params, hold_kv=True))
        out = await stream.get()
        assert out.finished and out.kv is not None
        return out

    def idle_within(seconds: float) -> float | None:
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            if not _slot_active(share_path, loop.core_share.slot):
                return time.monotonic() - start
            time.sleep(0.005)
        return None

    try:
        out = asyncio.run(prefill("sent"))
        assert idle_within(0.2) is None, "the cores were lent before the KV left"
        loop.handoffs.settled(out.kv)
        assert idle_within(2.0) is not None
        asyncio.run(prefill("never-sent"))
        held = idle_within(5.0)
        assert held is not None and 0.2 <= held <= 2.0, held
        # A new prompt during a hold is taken on the cores still held: no idle in between.
        idled: list[float] = []
        share_idle = loop.core_share.idle
        loop.core_share.idle = lambda: (idled.append(time.monotonic()), share_idle())[1]
        first = asyncio.run(prefill("held"))
        second = asyncio.run(prefill("during-the-hold"))
        assert not idled, "the cores were lent between the two prompts"
        loop.handoffs.settled(first.kv)
        loop.handoffs.settled(second.kv)
        assert idle_within(2.0) is not None
    finally:
        loop.stop()
