"""KVBufferPool: released buffers are reused, unreleased ones never are, idle memory is bounded."""

from __future__ import annotations

import torch

from kv_transfer import KVBufferPool

SHAPE = (2, 2, 4, 16, 2, 8)  # 8 KiB of float32


def test_released_buffer_is_reused_for_the_next_payload():
    pool = KVBufferPool(max_idle_bytes=1 << 20)
    first = pool.acquire(SHAPE, torch.float32)
    assert first.shape == SHAPE and first.dtype == torch.float32 and first.is_contiguous()
    address = first.data_ptr()
    assert pool.release(first[0])  # any view of the payload identifies its buffer
    second = pool.acquire(SHAPE, torch.float32)
    assert second.data_ptr() == address
    smaller = (2, 2, 3, 16, 2, 8)
    assert pool.release(second)
    assert pool.acquire(smaller, torch.float32).data_ptr() == address


def test_buffer_still_owned_by_the_callback_is_never_handed_out_again():
    pool = KVBufferPool()
    kept = pool.acquire(SHAPE, torch.float32)
    other = pool.acquire(SHAPE, torch.float32)
    assert other.data_ptr() != kept.data_ptr()


def test_foreign_buffers_and_second_releases_are_not_taken():
    pool = KVBufferPool()
    assert not pool.release(torch.zeros(SHAPE))
    lent = pool.acquire(SHAPE, torch.float32)
    assert pool.release(lent)
    assert not pool.release(lent)  # a second release is ignored, not a double entry
    assert pool.idle_bytes == lent.nbytes


def test_idle_bytes_stay_under_the_limit():
    pool = KVBufferPool(max_idle_bytes=20 << 10)
    buffers = [pool.acquire(SHAPE, torch.float32) for _ in range(4)]  # 4 x 8 KiB
    for buffer in buffers:
        pool.release(buffer)
    assert pool.idle_bytes == 16 << 10
