"""The KV receiver's store listens on the worker's --host alone. torch's TCPStore server,
given a host, still listened on every interface: a decode worker started with --host
127.0.0.1 had its KV port open to the network (an audit listed its keys and broke a live
channel from another host). Read from the kernel's socket table of this process."""

from __future__ import annotations

import os
from datetime import timedelta

import psutil
import pytest
from kv_harness import TIMEOUT_S, Inbox

from kv_transfer import KVLayout, KVReceiver
from kv_transfer.store import bound_store

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, dtype="float32")


def _listening(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process(os.getpid()).net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def test_the_kv_receiver_listens_on_its_host_alone():
    inbox = Inbox(wanted=lambda key: True)
    with KVReceiver("127.0.0.1", 0, LAYOUT, "cpu", timeout_s=TIMEOUT_S,
                    **inbox.receiver_kwargs()) as receiver:
        port = int(receiver.endpoint.rsplit(":", 1)[1])
        assert _listening(port) == {"127.0.0.1"}
    assert _listening(port) == set()  # the store closed the socket it took over


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_a_bound_store_listens_where_it_is_told_and_serves(host):
    store = bound_store(host, 0, timedelta(seconds=10))
    assert _listening(store.port) == {host}
    store.set("k", "v")
    assert store.get("k") == b"v"
