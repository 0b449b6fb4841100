"""Fixtures for kv_transfer tests: fresh or module-shared prefill peer processes."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from kv_harness import PeerProcess


@pytest.fixture
def spawn_peer() -> Iterator[Callable[[], PeerProcess]]:
    """Start fresh peer processes (for tests that kill them); all are reaped at teardown."""
    peers: list[PeerProcess] = []

    def spawn() -> PeerProcess:
        peer = PeerProcess()
        peers.append(peer)
        peer.expect("started")
        return peer

    yield spawn
    for peer in peers:
        peer.stop()


@pytest.fixture(scope="module")
def prefill_peers() -> Iterator[tuple[PeerProcess, PeerProcess]]:
    """Two long-lived prefill processes shared by a module's tests (tests use distinct sender
    names and receivers), started together so their torch imports overlap."""
    peers = (PeerProcess(), PeerProcess())
    for peer in peers:
        peer.expect("started")
    yield peers
    for peer in peers:
        peer.stop()
