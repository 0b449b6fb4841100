"""KV transfer between tensor-parallel workers, in one process: a sender of another degree or
another rank is refused at connect time with both degrees named, a prefill pool refuses a
decode worker advertising another number of endpoints before connecting, and rank 0 of a
decode worker hands KV to the engine only once every rank holds its shard."""

from __future__ import annotations

import argparse
import time

import pytest
import torch

from engine.executor import ShardedKV
from kv_transfer import KVLayout, KVReceiver, KVSender, KVSenderPool, LayoutMismatchError
from services.common.tp_kv import ShardedKVReceiver
from services.common.worker_cli import add_worker_arguments, worker_config_from_args

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
TIMEOUT_S = 5.0
MISMATCH = "tensor-parallel degree mismatch: decode worker has TP=2, prefill worker TP=1"


@pytest.fixture
def rank0_receiver():
    """Rank 0's KV receiver of a TP=2 decode worker."""
    receiver = KVReceiver("127.0.0.1", 0, LAYOUT, "cpu", on_kv=lambda h, p: None,
                          timeout_s=TIMEOUT_S, tp_rank=0, tp_size=2)
    yield receiver
    receiver.close()


def test_a_sender_of_another_degree_is_refused_at_connect_time(rank0_receiver):
    sender = KVSender(rank0_receiver.endpoint, LAYOUT, "cpu", TIMEOUT_S)  # a TP=1 prefill
    with pytest.raises(LayoutMismatchError, match=MISMATCH):
        sender.wait_ready()
    sender.close()
    assert rank0_receiver.stats.snapshot().refused == 1


def test_a_sender_of_another_rank_is_refused_at_connect_time(rank0_receiver):
    sender = KVSender(rank0_receiver.endpoint, LAYOUT, "cpu", TIMEOUT_S, tp_rank=1, tp_size=2)
    with pytest.raises(LayoutMismatchError, match="prefill rank 1 reached the KV endpoint of "
                                                  "decode rank 0"):
        sender.wait_ready()
    sender.close()


def test_a_pool_refuses_a_decode_worker_of_another_degree_before_connecting():
    with KVSenderPool(LAYOUT, "cpu", TIMEOUT_S) as pool:  # TP=1
        with pytest.raises(LayoutMismatchError, match=MISMATCH):
            pool.send("127.0.0.1:1,127.0.0.1:2", "r", 0, 4, torch.zeros(LAYOUT.payload_shape(1)))
        assert pool.endpoints() == []  # nothing was dialled
    with KVSenderPool(LAYOUT, "cpu", TIMEOUT_S, tp_rank=1, tp_size=2) as pool:
        with pytest.raises(LayoutMismatchError, match="decode worker has TP=1, prefill worker TP=2"):
            pool.sender("127.0.0.1:1")


def test_a_worker_size_that_does_not_split_the_heads_exits_naming_the_valid_sizes(tiny_llama_dir):
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, role=None)
    args = parser.parse_args(["--model", str(tiny_llama_dir), "--tensor-parallel-size", "3"])
    with pytest.raises(SystemExit) as exited:
        worker_config_from_args(args, role=None)
    assert str(exited.value).endswith("valid sizes: 1, 2, 4, 8")


class FakeExecutor:
    """The part of a TP=2 TensorParallelExecutor a ShardedKVReceiver talks to."""

    size = 2

    def __init__(self) -> None:
        self.dropped: list[str] = []
        self.on_kv_arrived = None
        self.on_kv_channel_error = None

    def open_kv_receivers(self, host, layout, timeout_s, shared_memory=True):
        return [f"{host}:1"]

    def drop_kv(self, handle: str) -> None:
        self.dropped.append(handle)


def _frame(key: str):
    from kv_transfer import KVHeader

    return KVHeader(key, 4, 1, 9, LAYOUT), torch.ones(LAYOUT.payload_shape(1))


def test_kv_reaches_the_engine_only_once_every_rank_holds_its_shard():
    delivered: list[tuple] = []
    executor = FakeExecutor()
    receiver = ShardedKVReceiver(executor, "127.0.0.1", 0, layout=LAYOUT, device=torch.device("cpu"),
                                 on_kv=lambda h, kv: delivered.append((h, kv)), timeout_s=TIMEOUT_S)
    try:
        assert receiver.endpoint.endswith(",127.0.0.1:1")
        receiver._arrived_here(*_frame("a"))
        executor.on_kv_arrived(1, "b")
        assert delivered == []
        executor.on_kv_arrived(1, "a")
        [(header, kv)] = delivered
        assert header.request_key == "a" and header.first_token == 9
        assert isinstance(kv, ShardedKV) and kv.handle == "recv/a" and kv.numel() == 2 * kv.local.numel()
        receiver.release(kv)
        assert executor.dropped == ["recv/a"]  # a no-op where rank 1 already scattered it
    finally:
        receiver.close()


def test_kv_that_never_reaches_every_rank_is_dropped_on_all_of_them():
    executor = FakeExecutor()
    receiver = ShardedKVReceiver(executor, "127.0.0.1", 0, layout=LAYOUT, device=torch.device("cpu"),
                                 on_kv=lambda h, kv: pytest.fail("incomplete KV delivered"),
                                 timeout_s=0.05)
    try:
        receiver._arrived_here(*_frame("lost"))  # rank 1's shard never comes
        time.sleep(0.15)
        executor.on_kv_arrived(1, "other")  # any later arrival sweeps the stale ones
        assert executor.dropped == ["recv/lost"]
    finally:
        receiver.close()
