"""Co-located workers lending cores (services/common/core_share.py): real processes sharing a
real file. A worker borrows an idle peer's threads and hands them back before that peer
steps; a peer that waits for them never waits past its limit; dead peers lend; workers
starting together get distinct slots; and an engine loop over a real engine steps on the
threads the share grants, on its own thread only."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch
from prometheus_client import generate_latest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from services.common.core_share import CoreShare
from services.common.engine_loop import EngineLoop
from services.common.metrics import WorkerMetrics
from services.common.worker_config import WorkerConfig

pytestmark = pytest.mark.timeout(120)

_SPAWN = multiprocessing.get_context("spawn")


def _peer(path: str, conn, wait_limit_s: float, prefill: bool) -> None:
    """A worker in its own process, driven over a pipe: "step" (answers the threads and when
    step_threads returned), "idle", "stats", "exit". It does not borrow, unless it is a
    prefill worker (priority: its steps go first, on every core it can get)."""
    share = CoreShare(path, 1, borrow=prefill, cores=2, wait_limit_s=wait_limit_s,
                      priority=prefill)
    conn.send(("ready", share.slot))
    while True:
        command = conn.recv()
        if command == "step":
            threads = share.step_threads()
            conn.send((threads, time.monotonic()))
        elif command == "idle":
            share.idle()
            conn.send("ok")
        elif command == "stats":
            conn.send((share.waits, share.wait_seconds))
        else:
            share.close()
            conn.send("bye")
            return


class Peer:
    def __init__(self, path: str, wait_limit_s: float = 5.0, prefill: bool = False) -> None:
        self.conn, child = _SPAWN.Pipe()
        self.process = _SPAWN.Process(target=_peer, args=(path, child, wait_limit_s, prefill),
                                      daemon=True)
        self.process.start()
        assert self.conn.poll(60), "the peer process did not start"
        self.slot = self.conn.recv()[1]

    def ask(self, command: str, timeout: float = 30.0):
        self.conn.send(command)
        assert self.conn.poll(timeout), f"the peer did not answer {command!r}"
        return self.conn.recv()

    def stop(self) -> None:
        if self.process.is_alive():
            self.ask("exit")
        self.process.join(10)


@pytest.fixture
def share_path(tmp_path):
    return str(tmp_path / "cores")


def test_borrower_takes_an_idle_peers_threads_and_hands_them_back_before_it_steps(share_path):
    peer = Peer(share_path)
    decode = CoreShare(share_path, 1, borrow=True, cores=2)
    try:
        assert decode.slot != peer.slot
        assert decode.step_threads() == 2  # the peer is idle: its thread is lent
        assert decode.borrowed == 1
        # The peer turns active while the decode side holds its thread: it waits until the
        # decode side's next step boundary hands it back, then steps on its own thread.
        peer.conn.send("step")
        time.sleep(0.4)
        assert not peer.conn.poll(0), "the peer stepped while its thread was still borrowed"
        handed_back_at = time.monotonic()
        assert decode.step_threads() == 1  # the peer is active: nothing to borrow
        assert peer.conn.poll(10)
        threads, stepped_at = peer.conn.recv()
        assert threads == 1 and stepped_at >= handed_back_at
        waits, waited = peer.ask("stats")
        assert waits == 1 and waited >= 0.35
        # Both on their own threads: neither waits for the other.
        assert peer.ask("step")[0] == 1 and decode.step_threads() == 1
        peer.ask("idle")
        assert decode.step_threads() == 2
        decode.idle()  # an idle borrower holds nothing: the peer steps at once
        start = time.monotonic()
        assert peer.ask("step")[0] == 1 and time.monotonic() - start < 0.2
        assert peer.ask("stats")[0] == 1
    finally:
        peer.stop()
        decode.close()


def test_a_peer_never_waits_past_its_limit_for_a_borrower_that_does_not_step(share_path):
    peer = Peer(share_path, wait_limit_s=0.3)
    decode = CoreShare(share_path, 1, borrow=True, cores=2)
    try:
        assert decode.step_threads() == 2  # ... and then a step that never ends
        start = time.monotonic()
        assert peer.ask("step")[0] == 1
        assert 0.25 <= time.monotonic() - start < 3.0
        waits, waited = peer.ask("stats")
        assert waits == 1 and 0.25 <= waited < 3.0
    finally:
        peer.stop()
        decode.close()


def test_a_dead_peers_threads_are_lent_and_its_slot_reused(share_path):
    peer = Peer(share_path)
    decode = CoreShare(share_path, 1, borrow=True, cores=2, liveness_every_s=0.0)
    try:
        peer.ask("idle")
        assert peer.ask("step")[0] == 1  # active, then killed without a word
        assert decode.step_threads() == 1
        os.kill(peer.process.pid, signal.SIGKILL)
        peer.process.join(10)
        assert decode.step_threads() == 2
        replacement = Peer(share_path)
        try:
            assert replacement.slot == peer.slot
        finally:
            replacement.stop()
    finally:
        decode.close()


def test_a_closed_worker_frees_its_slot_and_lends_everything(share_path):
    peer = Peer(share_path)
    decode = CoreShare(share_path, 1, borrow=True, cores=2)
    try:
        assert peer.ask("step")[0] == 1
        assert decode.step_threads() == 1
        peer.stop()
        assert decode.step_threads() == 2
    finally:
        decode.close()


class Stepper:
    """Calls step_threads of a CoreShare of this process on a thread (it may pause there)."""

    def __init__(self, share: CoreShare) -> None:
        self.result: list[tuple[int, float]] = []
        self.thread = threading.Thread(
            target=lambda: self.result.append((share.step_threads(), time.monotonic())))
        self.thread.start()

    def wait(self, timeout: float) -> tuple[int, float]:
        self.thread.join(timeout)
        assert self.result, f"step_threads did not return within {timeout} s"
        return self.result[0]


def test_a_prefill_worker_asks_and_a_willing_decoder_pauses_while_it_steps(share_path):
    prefill = Peer(share_path, prefill=True)
    decode = CoreShare(share_path, 1, borrow=True, cores=2, yield_burst_s=10.0)
    try:
        assert decode.step_threads() == 2  # the prefill worker idles: its thread is lent
        # It asks at its step boundary and waits (briefly) for the decoder's next boundary,
        # where the decoder pauses, lending its thread: the prompt runs on both cores.
        prefill.conn.send("step")
        time.sleep(0.05)
        stepper = Stepper(decode)
        assert prefill.conn.poll(10)
        assert prefill.conn.recv()[0] == 2
        time.sleep(0.4)
        assert stepper.thread.is_alive(), "the decoder stepped while the prefill worker did"
        # Another prompt step: asked again, the decoder stays paused.
        assert prefill.ask("step")[0] == 2
        time.sleep(0.2)
        assert stepper.thread.is_alive()
        idled_at = time.monotonic()
        prefill.ask("idle")  # no prompts left: the decoder steps, on both cores
        threads, stepped_at = stepper.wait(5)
        assert threads == 2 and 0 <= stepped_at - idled_at < 1.0
        assert decode.yields == 1 and decode.yield_seconds >= 0.6
    finally:
        prefill.stop()
        decode.close()


def test_a_decoders_pause_is_bounded_by_its_credit_and_without_credit_nobody_waits(share_path):
    prefill = Peer(share_path, prefill=True)
    decode = CoreShare(share_path, 1, borrow=True, cores=2, wait_limit_s=0.3,
                       yield_share=0.5, yield_burst_s=0.3)
    try:
        assert prefill.ask("step")[0] == 2  # the decoder idles: no one to ask
        # A prompt step that never ends: the decoder pauses for its credit (0.3 s), then
        # waits for the cores (0.3 s), then steps on its own thread.
        start = time.monotonic()
        assert decode.step_threads() == 1
        assert 0.5 <= time.monotonic() - start < 3.0
        assert decode.yields == 1 and decode.yield_seconds >= 0.5
        # Its credit is spent: it no longer pauses, and the prefill worker's next step does
        # not wait for it; both step on their own threads.
        start = time.monotonic()
        assert prefill.ask("step")[0] == 1
        assert time.monotonic() - start < 0.15
        start = time.monotonic()
        assert decode.step_threads() == 1
        assert time.monotonic() - start < 0.1 and decode.yields == 1
    finally:
        prefill.stop()
        decode.close()


def test_a_decoder_with_yield_share_zero_never_pauses(share_path):
    prefill = Peer(share_path, prefill=True)
    decode = CoreShare(share_path, 1, borrow=True, cores=2, yield_share=0.0)
    try:
        assert prefill.ask("step")[0] == 2
        prefill.ask("idle")
        assert decode.step_threads() == 2
        prefill.conn.send("step")  # waits for the borrowed thread, not for a pause
        time.sleep(0.3)
        assert not prefill.conn.poll(0)
        start = time.monotonic()
        assert decode.step_threads() == 1
        assert time.monotonic() - start < 0.1 and decode.yields == 0
        assert prefill.conn.poll(5) and prefill.conn.recv()[0] == 1
    finally:
        prefill.stop()
        decode.close()


def _join(path: str, start, conn) -> None:
    start.wait(30)
    share = CoreShare(path, 1, borrow=False)
    conn.send(share.slot)
    conn.recv()  # hold the slot until every worker has one


def test_workers_starting_together_take_distinct_slots(share_path):
    start = _SPAWN.Event()
    pipes, processes = [], []
    for _ in range(6):
        parent, child = _SPAWN.Pipe()
        process = _SPAWN.Process(target=_join, args=(share_path, start, child), daemon=True)
        process.start()
        pipes.append(parent)
        processes.append(process)
    time.sleep(1.0)
    start.set()
    try:
        slots = []
        for parent in pipes:
            assert parent.poll(60)
            slots.append(parent.recv())
        assert len(set(slots)) == 6, slots
    finally:
        for parent in pipes:
            parent.send("done")
        for process in processes:
            process.join(10)


def test_core_share_needs_own_threads_and_one_process(tiny_llama_dir, share_path):
    with pytest.raises(ValueError, match="--core-share"):
        WorkerConfig(role="decode", model=str(tiny_llama_dir), core_share=share_path)
    with pytest.raises(ValueError, match="--core-share"):
        WorkerConfig(role="decode", model=str(tiny_llama_dir), core_share=share_path,
                     num_threads=1, tensor_parallel_size=2)
    WorkerConfig(role="decode", model=str(tiny_llama_dir), core_share=share_path, num_threads=1)
    with pytest.raises(ValueError, match="--core-share-yield"):
        WorkerConfig(role="decode", model=str(tiny_llama_dir), core_share=share_path,
                     num_threads=1, core_share_yield=1.5)
    with pytest.raises(ValueError, match="--core-share-yield-burst-s"):
        WorkerConfig(role="decode", model=str(tiny_llama_dir), core_share=share_path,
                     num_threads=1, core_share_yield_burst_s=-0.1)


def test_the_yield_burst_flows_from_the_environment_to_the_workers_share(tiny_llama_dir,
                                                                        share_path, monkeypatch):
    """SPLITSERVE_CORE_SHARE_YIELD_BURST_S (what bench.compare sets for a candidate default),
    through the CLI and WorkerConfig, into the CoreShare a real Worker builds."""
    import argparse

    from services.common.server import Worker
    from services.common.worker_cli import add_worker_arguments, worker_config_from_args

    monkeypatch.setenv("SPLITSERVE_CORE_SHARE_YIELD_BURST_S", "0.8")
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, role="decode")
    config = worker_config_from_args(parser.parse_args(
        ["--model", str(tiny_llama_dir), "--core-share", share_path, "--num-threads", "1",
         "--num-kv-blocks", "64", "--dtype", "float32"]), "decode")
    assert config.core_share_yield_burst_s == 0.8
    worker = Worker(config)
    try:
        share = worker.engine_loop.core_share
        assert (share.yield_burst_s, share.yield_share) == (0.8, 0.5)
    finally:
        worker.engine_loop.core_share.close()
        worker.engine.close()


def test_engine_loop_steps_on_the_threads_the_share_grants(tiny_llama_dir, share_path):
    """A borrowing worker's engine loop over a real engine: two threads while the peer idles,
    one while it works, the same greedy tokens either way."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32",
                                    num_kv_blocks=64, num_threads=1))
    loop = EngineLoop(engine, idle_wait_s=0.01)
    loop.core_share = CoreShare(share_path, 1, borrow=True, cores=2)
    metrics = WorkerMetrics("decode", "w", model="tiny")
    metrics.attach(loop)
    peer = Peer(share_path)
    loop.start()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def generate(rid: str) -> tuple[list[int], list[int]]:
        stream, _ = await loop.open(rid, lambda e: e.add_request(rid, list(range(5, 37)), params))
        tokens: list[int] = []
        threads: list[int] = []
        while True:
            out = await stream.get()
            tokens += out.new_token_ids
            threads.append(loop.step_threads)
            if out.finished:
                # Read on the engine thread: the count torch's next parallel region there uses.
                threads.append(await loop.call(lambda e: torch.get_num_threads()))
                return tokens, threads

    def fresh_thread_threads() -> int:
        seen: list[int] = []
        thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        return seen[0]

    try:
        lent, lent_threads = asyncio.run(generate("lent"))
        assert set(lent_threads) == {2}, lent_threads
        # Only the engine thread's team grew: a thread that starts torch work now (a KV
        # receiver copying a payload) still gets one thread, so it starts no second team.
        assert fresh_thread_threads() == 1
        peer.ask("step")  # the peer works: the next steps run on the loop's own thread
        own, own_threads = asyncio.run(generate("own"))
        assert set(own_threads) == {1}, own_threads
        assert own == lent and len(own) == 6
        text = generate_latest(metrics.registry).decode()
        assert 'splitserve_worker_step_threads{model="tiny",role="decode"} 1.0' in text
        assert 'splitserve_worker_core_share_waits_total{model="tiny",role="decode"} 0.0' in text
        assert 'splitserve_worker_core_share_yields_total{model="tiny",role="decode"} 0.0' in text
    finally:
        loop.stop()
        peer.stop()


def test_an_idle_loop_prefaults_its_kv_pool_only_while_no_peer_steps(tiny_llama_dir, share_path,
                                                                    monkeypatch):
    """The idle engine loop's KV prefault (engine/kv_prefault.py) runs on a core a stepping
    peer's team would use, so it waits while a peer (its own process) is active and runs once
    the peer idles; SPLITSERVE_CPU_KV_PREFAULT_TOKENS reaches the engine through the CLI."""
    import argparse

    from services.common.worker_cli import add_worker_arguments, worker_config_from_args

    monkeypatch.setenv("SPLITSERVE_CPU_KV_PREFAULT_TOKENS", "48")
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, role="decode")
    config = worker_config_from_args(parser.parse_args(
        ["--model", str(tiny_llama_dir), "--num-threads", "1", "--num-kv-blocks", "64",
         "--dtype", "float32"]), "decode")
    assert config.cpu_kv_prefault_tokens == 48
    with pytest.raises(ValueError, match="cpu_kv_prefault_tokens"):
        WorkerConfig(role="decode", model=str(tiny_llama_dir), cpu_kv_prefault_tokens=-3)
    engine = LLMEngine(config.engine_config())
    assert engine.kv_prefault.margin_blocks == 48 // engine.config.block_size
    peer = Peer(share_path)
    loop = EngineLoop(engine, idle_wait_s=0.01)
    loop.core_share = CoreShare(share_path, 1, borrow=True, cores=2)
    try:
        peer.ask("step")
        loop.start()
        time.sleep(0.5)
        assert engine.kv_prefault.faulted == 0, "prefaulted while the peer stepped"
        peer.ask("idle")
        deadline = time.monotonic() + 30
        while engine.kv_prefault.faulted < engine.kv_prefault.target(0):
            assert time.monotonic() < deadline, "no prefault once the peer idled"
            time.sleep(0.01)
    finally:
        loop.stop()
        peer.stop()


def test_a_paused_loop_still_takes_new_requests(tiny_llama_dir, share_path):
    """A decoder paused for a prefilling peer (its own process, stepping on both cores) runs
    its queued commands while it waits: a new request is added within milliseconds, not after
    the pause (which here would last its whole 10 s credit), and no step runs until the peer
    idles. In a disaggregated deployment that command is the new request's KV reservation,
    which the gateway needs before it sends the prompt to the prefill worker."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32",
                                    num_kv_blocks=64, num_threads=1))
    loop = EngineLoop(engine, idle_wait_s=0.01)
    loop.core_share = CoreShare(share_path, 1, borrow=True, cores=2, yield_burst_s=10.0)
    peer = Peer(share_path, prefill=True)
    loop.start()
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)

    async def scenario() -> None:
        running, _ = await loop.open("running", lambda e: e.add_request(
            "running", list(range(5, 37)), params))
        await running.get()  # it steps
        steps = engine.num_steps
        assert peer.ask("step")[0] == 2  # the decoder paused at its next boundary
        await asyncio.sleep(0.2)
        paused_at = engine.num_steps
        assert paused_at <= steps + 2
        start = time.monotonic()
        added, _ = await asyncio.wait_for(loop.open("new", lambda e: e.add_request(
            "new", list(range(7, 20)), SamplingParams(max_tokens=4, temperature=0.0,
                                                      ignore_eos=True))), 2.0)
        assert time.monotonic() - start < 1.0
        await asyncio.sleep(0.2)
        assert engine.num_steps == paused_at, "the decoder stepped while the peer did"
        assert loop.core_share.yields == 0  # still in its first pause
        peer.ask("idle")
        tokens: list[int] = []
        while True:
            out = await asyncio.wait_for(added.get(), 10.0)
            tokens += out.new_token_ids
            if out.finished:
                break
        assert len(tokens) == 4

    try:
        asyncio.run(scenario())
    finally:
        loop.stop()
        peer.stop()
