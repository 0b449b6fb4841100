"""A small, round-numbered HardwareProfile for the autoscaler tests."""

from __future__ import annotations

from services.autoscaler.profile import DecodePoint, HardwareProfile, PrefillPoint


def make_profile(**overrides) -> HardwareProfile:
    """A small, round-numbered profile: prefill 1000 tokens/s flat; a decode step of 20 ms plus
    5 ms per sequence at context 128 (twice the per-sequence cost at 1024); 1000 KV blocks."""
    fields = dict(
        model="test", device="cpu", dtype="float32", num_threads=1, block_size=16, kv_blocks=1000,
        kv_bytes_per_block=1 << 16, max_num_batched_tokens=2048, max_num_seqs=128,
        long_prefill_token_threshold=512, model_load_s=2.0, worker_start_s=5.0,
        prefill=(PrefillPoint(64, 0.064), PrefillPoint(512, 0.512), PrefillPoint(2048, 2.048)),
        decode=(DecodePoint(1, 128, 0.025), DecodePoint(32, 128, 0.180),
                DecodePoint(1, 1024, 0.030), DecodePoint(32, 1024, 0.340)),
    )
    fields.update(overrides)
    return HardwareProfile(**fields)
