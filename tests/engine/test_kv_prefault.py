"""The idle-time prefault of the CPU KV pool (engine/kv_prefault.py): the pages of the next
blocks become resident (asked of the kernel with mincore), nothing else does, no byte
changes; the engine keeps it a margin ahead of the blocks it handed out; the engine loop runs
it while idle. Real mappings, a real engine (tiny random model) and a real loop thread."""

from __future__ import annotations

import ctypes
import mmap
import time

import pytest
import torch

from engine.config import EngineConfig
from engine.kv_cache_manager import cdiv
from engine.kv_prefault import KVPrefault
from engine.kv_tensor import zeroed
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from services.common.engine_loop import EngineLoop

pytestmark = pytest.mark.timeout(120)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def resident_blocks(pool: torch.Tensor) -> list[set[int]]:
    """Per (layer, K/V) plane, the blocks whose pages are all resident (mincore)."""
    nbytes = pool.numel() * pool.element_size()
    pages = -(-nbytes // mmap.PAGESIZE)
    vec = ctypes.create_string_buffer(pages)
    assert _libc.mincore(pool.data_ptr(), nbytes, vec) == 0, ctypes.get_errno()
    present = [vec.raw[i] & 1 for i in range(pages)]
    blocks, block_bytes = pool.shape[2], pool[0, 0, 0].numel() * pool.element_size()
    out = []
    for plane in range(pool.shape[0] * pool.shape[1]):
        base = plane * blocks * block_bytes
        out.append({b for b in range(blocks)
                    if all(present[(base + b * block_bytes) // mmap.PAGESIZE:
                                   -(-(base + (b + 1) * block_bytes) // mmap.PAGESIZE)])})
    return out


def test_prefault_makes_the_next_blocks_resident_and_changes_no_byte():
    # 3 layers x (K, V), 64 blocks of one page each per plane (16 x 2 x 64 bf16 = 4 KiB).
    pool = zeroed((3, 2, 64, 16, 2, 64), torch.bfloat16, torch.device("cpu"))
    pool[1, 0, 2] = 1.5  # a block already written: its bytes must survive
    assert resident_blocks(pool)[2] == {2} and resident_blocks(pool)[0] == set()
    prefault = KVPrefault(pool, margin_blocks=10)
    assert prefault.target(high_water=3) == 13 and prefault.target(high_water=60) == 64
    slices = 0
    while prefault.advance(high_water=3):
        slices += 1
    assert slices >= 1 and prefault.faulted == 13
    for plane, blocks in enumerate(resident_blocks(pool)):
        assert set(range(13)) <= blocks, plane
        assert not blocks & set(range(14, 64)), plane  # nothing far past the target
    assert bool((pool[1, 0, 2] == 1.5).all())
    assert int(torch.count_nonzero(pool)) == pool[1, 0, 2].numel()
    assert not prefault.advance(high_water=3)  # caught up: nothing to do
    assert prefault.advance(high_water=40) and prefault.faulted > 13  # the mark moved on


def test_prefault_checks_its_pool():
    with pytest.raises(ValueError, match="margin_blocks"):
        KVPrefault(zeroed((1, 2, 4, 16, 1, 64), torch.bfloat16, torch.device("cpu")), 0)
    with pytest.raises(ValueError, match="contiguous CPU pool"):
        KVPrefault(torch.zeros(1, 2, 4, 16, 1, 64).transpose(2, 3), 4)


def engine_of(model_dir, **config) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=512,
                                  num_threads=1, **config))


def test_the_engine_keeps_its_prefault_a_margin_ahead_of_the_blocks_it_handed_out(tiny_llama_dir):
    engine = engine_of(tiny_llama_dir)
    margin = cdiv(4 * engine.config.scheduler.max_num_batched_tokens, engine.config.block_size)
    assert engine.kv_prefault is not None and engine.kv_prefault.margin_blocks == margin
    engine.generate([list(range(5, 45))], SamplingParams(max_tokens=4, ignore_eos=True))
    high_water = engine.kv.pool.high_water
    assert high_water == cdiv(44, engine.config.block_size)
    while engine.prefault_kv():
        pass
    assert engine.kv_prefault.faulted == min(engine.kv.num_blocks, high_water + margin)
    planes = resident_blocks(engine.runner.kv_cache)
    assert all(set(range(engine.kv_prefault.faulted)) <= blocks for blocks in planes)

    assert engine_of(tiny_llama_dir, cpu_kv_prefault_tokens=0).kv_prefault is None
    assert not engine_of(tiny_llama_dir, cpu_kv_prefault_tokens=0).prefault_kv()
    small = engine_of(tiny_llama_dir, cpu_kv_prefault_tokens=100)
    assert small.kv_prefault.margin_blocks == cdiv(100, small.config.block_size)
    with pytest.raises(ValueError, match="cpu_kv_prefault_tokens"):
        engine_of(tiny_llama_dir, cpu_kv_prefault_tokens=-2)


def test_the_engine_loop_prefaults_while_idle(tiny_llama_dir):
    engine = engine_of(tiny_llama_dir, cpu_kv_prefault_tokens=64)
    loop = EngineLoop(engine, idle_wait_s=0.01)
    loop.start()
    try:
        deadline = time.monotonic() + 30
        while engine.kv_prefault.faulted < engine.kv_prefault.target(0):
            assert time.monotonic() < deadline, "the idle loop did not prefault"
            time.sleep(0.01)
        assert loop.ready
    finally:
        loop.stop()
    assert all(set(range(engine.kv_prefault.faulted)) <= blocks
               for blocks in resident_blocks(engine.runner.kv_cache))
