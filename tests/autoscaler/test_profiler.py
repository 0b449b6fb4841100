"""`splitserve profile` on the tiny model: measures every point it promises and writes a
profile the planner can read."""

from __future__ import annotations

import json

from services.autoscaler.profile import HardwareProfile
from splitserve_cli.main import main


def test_quick_profile_measures_prefill_decode_and_kv(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert main(["profile", "--model", str(tiny_llama_dir), "--quick", "--no-worker-start",
                 "--kv-cache-memory", "8MiB", "--out", str(out)]) == 0
    profile = HardwareProfile.load(out)
    assert [p.batch_tokens for p in profile.prefill] == [64, 512, 2048]
    # The tiny model's context is 512 tokens: only the 128-token column fits.
    assert [(p.batch_size, p.context_len) for p in profile.decode] == [(1, 128), (8, 128), (32, 128)]
    assert all(p.seconds > 0 for p in (*profile.prefill, *profile.decode))
    assert profile.kv_blocks > 0 and profile.kv_bytes_per_block > 0
    assert profile.model_load_s > 0 and profile.worker_start_s == 0
    assert profile.decode_step_seconds(64, 2048) > profile.decode_step_seconds(1, 128)
    notes = json.loads(out.read_text())["notes"]
    assert notes["quick"] is True
    # How much other processes slowed each point (Linux schedstat): one factor per point.
    assert len(notes["point_slowdown"]) == len(profile.prefill) + len(profile.decode)
    assert all(f >= 1.0 for f in notes["point_slowdown"])
    assert "prefill" in capsys.readouterr().out


def test_colocated_profile_times_points_beside_a_streaming_decode_worker(tiny_llama_dir, tmp_path):
    out = tmp_path / "profile.json"
    assert main(["profile", "--model", str(tiny_llama_dir), "--quick", "--no-worker-start",
                 "--kv-cache-memory", "8MiB", "--colocated", "--out", str(out)]) == 0
    profile = HardwareProfile.load(out)
    colocated = profile.notes["colocated"]
    assert colocated["decode_batch"] == 1
    assert colocated["tokens_streamed"] > 0  # the other phase really ran meanwhile
    assert all(p.seconds > 0 for p in (*profile.prefill, *profile.decode))


def test_validate_gates_a_colocated_profile_as_profiled(profile):
    import dataclasses

    from bench.autoscaler_sim import _gated

    both = {"as profiled": {}, "CPU share replayed": {}}
    assert _gated(profile, both) == "CPU share replayed"
    assert _gated(profile, {"as profiled": {}}) == "as profiled"
    colocated = dataclasses.replace(profile, notes={**profile.notes, "colocated": {"decode_batch": 1}})
    assert _gated(colocated, both) == "as profiled"
