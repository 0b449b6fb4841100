"""The C++ small-M bfloat16 linear kernel (kernels/cpu/small_m_linear.cpp) against its torch
reference, kernels.linear.small_m_linear_reference, and the engine with either linear path."""

from __future__ import annotations

import fcntl
import os
import threading

import pytest
import torch
from engine_harness import drive, make_engine, parse_worker_flags
from kernel_build import require_cpu_kernels

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerConfig
from kernels import cpu_kernels, linear
from kernels.linear import (
    SMALL_M_CANDIDATES,
    SMALL_M_MAX_ROWS,
    calibrate_small_m_max_rows,
    calibration_weights,
    small_m_linear_available,
    small_m_linear_reference,
)
from services.common.worker_config import WorkerConfig

pytestmark = require_cpu_kernels()

needs_avx512_bf16 = pytest.mark.skipif(
    not cpu_kernels.load() or not small_m_linear_available(), reason="the CPU lacks avx512_bf16"
)

# Both sides round one float32 sum to bf16; summed in another order, the sums differ by a few
# float32 ulps, which can move the rounded result by one bf16 ulp (2^-8 relative).
RTOL, ATOL = 2**-7, 1e-3


def _case(m: int, n: int, k: int, bias: bool, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator).bfloat16()
    weight = torch.randn(n, k, generator=generator).bfloat16()
    b = torch.randn(n, generator=generator).bfloat16() if bias else None
    return x, weight, b


def _kernel(x, weight, bias=None, portable=False):
    return torch.ops.splitserve_cpu.small_m_linear(x, weight, bias, portable)


PATHS = [pytest.param(False, marks=needs_avx512_bf16, id="avx512_bf16"),
         pytest.param(True, id="portable")]


@pytest.mark.parametrize("portable", PATHS)
@pytest.mark.parametrize("n,k", [
    (960, 576),  # SmolLM2 qkv: whole tiles, K a multiple of 32
    (67, 576),  # N not a multiple of the 4-row tile
    (13, 1536),  # SmolLM2 down_proj's K
    (6, 64),
    (37, 100),  # K not a multiple of 32: the masked tail
    (3, 7),  # all tail
])
@pytest.mark.parametrize("bias", [False, True])
def test_small_m_linear_matches_the_torch_reference(portable, n, k, bias):
    for m in range(1, max(SMALL_M_MAX_ROWS, 9) + 1):  # beyond the engine's threshold as well
        x, weight, b = _case(m, n, k, bias, seed=m)
        out = _kernel(x, weight, b, portable)
        assert out.dtype == torch.bfloat16 and out.shape == (m, n)
        torch.testing.assert_close(out, small_m_linear_reference(x, weight, b), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("portable", PATHS)
def test_small_m_linear_reads_strided_rows_and_copies_strided_columns(portable):
    x, weight, _ = _case(3, 40, 96, bias=False)
    wide = torch.randn(3, 200).bfloat16()
    wide[:, 50:146] = x
    rows = wide[:, 50:146]  # a row stride of 200, as a slice of a fused projection
    columns = x.T.contiguous().T  # unit stride along M, not along K
    expected = small_m_linear_reference(x, weight)
    for view in (rows, columns):
        torch.testing.assert_close(_kernel(view, weight, None, portable), expected, rtol=RTOL, atol=ATOL)


def test_small_m_linear_takes_no_rows_and_rejects_float32():
    x, weight, _ = _case(1, 8, 32, bias=False)
    assert _kernel(x[:0], weight).shape == (0, 8)
    with pytest.raises(RuntimeError, match="bfloat16"):
        _kernel(x.float(), weight.float())


def _bf16_engine(model_dir, cpu_linear: str) -> LLMEngine:
    # One token per step, prompts included, so that every matmul of every step has M = 1.
    scheduler = SchedulerConfig(max_num_batched_tokens=1, long_prefill_token_threshold=1)
    return LLMEngine(EngineConfig(
        model=str(model_dir), dtype="bfloat16", device="cpu", block_size=4, num_kv_blocks=64,
        scheduler=scheduler, cpu_linear=cpu_linear,
    ))


@needs_avx512_bf16
def test_engine_logprobs_agree_with_either_linear_in_bfloat16(tiny_llama_dir):
    """The kernel and torch's bf16 mm sum in different orders, and every layer rounds its output
    to bf16, so the two paths' logits differ in the last bits; greedy tokens of a random tiny
    model may then legitimately part at a near-tie. So the same (teacher-forced) prompt is scored
    by both and the prompt logprobs compared within a bf16 tolerance; the profiler shows the
    kernel really ran in one engine and not in the other."""
    prompt = list(range(5, 5 + 24))
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    logprobs, calls = {}, {}
    for choice in ("torch", "cpp"):
        engine = _bf16_engine(tiny_llama_dir, choice)
        assert engine.runner.small_m_linear == (choice == "cpp")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            engine.add_request("r", prompt, params)
            result = drive(engine)["r"]
        calls[choice] = sum(e.count for e in prof.key_averages() if "small_m_linear" in e.key)
        logprobs[choice] = torch.tensor([p.logprob for p in result.prompt_logprobs[1:]])
    assert calls["torch"] == 0 and calls["cpp"] > 0
    # Logits of about 10 are a bf16 ulp (1/16) apart; torch.testing's bf16 rtol is two ulps.
    # (Measured: at most 0.04 apart; a wrong kernel is off by whole nats.)
    torch.testing.assert_close(logprobs["cpp"], logprobs["torch"], rtol=1.6e-2, atol=1e-2)


def test_cpu_linear_cpp_in_float32_is_a_clear_error(tiny_llama_dir):
    with pytest.raises(ValueError, match="cpu_linear 'cpp' needs --dtype bfloat16"):
        LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu",
                               num_kv_blocks=16, cpu_linear="cpp"))


@needs_avx512_bf16
def test_the_calibration_keeps_the_row_counts_the_kernel_wins_and_stops_at_two_losses():
    """Real timings of both paths on small weights; the margin decides: a kernel that may take
    any multiple of torch's time keeps every count tried, one that must take no time keeps
    none and stops after two losses in a row."""
    weights = [torch.randn(96, 64).bfloat16(), torch.randn(64, 96).bfloat16()]
    every = calibrate_small_m_max_rows(weights, repeats=1, margin=1e9)
    assert every.max_rows == SMALL_M_CANDIDATES[-1]
    assert [rows for rows, _, _ in every.timings] == list(SMALL_M_CANDIDATES)
    assert all(cpp > 0 and ref > 0 for _, cpp, ref in every.timings)
    none = calibrate_small_m_max_rows(weights, repeats=1, margin=0.0)
    assert none.max_rows == 0 and len(none.timings) == 2
    assert "up to 0 rows" in none.describe()


def test_one_lost_row_count_does_not_end_the_calibration(monkeypatch):
    """Scripted timings (the clock's noise cannot be produced on demand): the kernel loses at
    1 row (0.93 of torch's time, as a worker calibrating beside another once measured), wins
    at 4 and 8, loses at 16 and 32: it keeps up to 8 rows and tries no more than 32."""
    share = {1: 0.93, 4: 0.6, 8: 0.7, 16: 0.95, 32: 1.2, 64: 0.1}
    rows_seen = []

    def scripted(fns, repeats):
        rows = SMALL_M_CANDIDATES[len(rows_seen)]  # the counts are tried in order
        rows_seen.append(rows)
        return {"cpp": share[rows], "torch": 1.0}

    monkeypatch.setattr(linear, "best_seconds", scripted)
    calibration = calibrate_small_m_max_rows([torch.randn(8, 8).bfloat16()], repeats=1)
    assert calibration.max_rows == 8
    assert [rows for rows, _, _ in calibration.timings] == [1, 4, 8, 16, 32]


def test_calibration_weights_are_the_first_projections_not_the_lm_head(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    model = engine.runner.model
    weights = calibration_weights(model, budget=1 << 30)  # all of them
    assert weights and all(w.dim() == 2 for w in weights)
    assert all(w.data_ptr() != model.lm_head.weight.data_ptr() for w in weights)
    assert len(calibration_weights(model, budget=1)) == 1


@needs_avx512_bf16
@pytest.mark.parametrize(("cpu_linear", "fixed", "expected"), [
    ("auto", 4, 4), ("auto", 0, 0), ("cpp", -1, SMALL_M_MAX_ROWS), ("torch", 8, 0)])
def test_a_fixed_row_count_or_cpu_linear_cpp_skips_the_calibration(tiny_llama_dir, cpu_linear,
                                                                  fixed, expected):
    engine = LLMEngine(EngineConfig(
        model=str(tiny_llama_dir), dtype="bfloat16", device="cpu", num_kv_blocks=16,
        cpu_linear=cpu_linear, cpu_small_m_max_rows=fixed))
    assert engine.runner.small_m_max_rows == expected
    layers = [m for m in engine.runner.model.modules() if hasattr(m, "small_m_max_rows")]
    assert {m.small_m_max_rows for m in layers} == {expected}


def test_the_worker_flag_reaches_the_engine_and_bad_values_are_refused(tiny_llama_dir, monkeypatch):
    from services.common.worker_config import WorkerConfig

    def parse(*argv: str) -> WorkerConfig:
        return parse_worker_flags(tiny_llama_dir, *argv)

    assert parse().engine_config().cpu_small_m_max_rows == -1  # measured at start
    assert parse("--cpu-small-m-max-rows", "16").engine_config().cpu_small_m_max_rows == 16
    monkeypatch.setenv("SPLITSERVE_CPU_SMALL_M_MAX_ROWS", "0")
    assert parse().cpu_small_m_max_rows == 0
    for bad in (-2, 65):
        with pytest.raises(ValueError, match="--cpu-small-m-max-rows must be -1"):
            WorkerConfig(role="decode", model=str(tiny_llama_dir), cpu_small_m_max_rows=bad)


@needs_avx512_bf16
def test_a_worker_times_its_kernels_only_while_it_holds_the_measurement_lock(tiny_llama_dir, tmp_path):
    """Workers sharing a host's cores take turns timing kernels at start: while a peer holds
    the lock (a real flock on the file `splitserve up` names), this engine's build waits at its
    first measurement, and finishes once the lock is released."""
    lock = tmp_path / "cores.measure"
    peer = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(peer, fcntl.LOCK_EX)
    built: list = []
    thread = threading.Thread(target=lambda: built.append(make_engine(
        tiny_llama_dir, dtype="bfloat16", start_measurement_lock=str(lock))))
    thread.start()
    try:
        thread.join(3.0)
        assert thread.is_alive() and not built  # waiting for the peer
    finally:
        os.close(peer)
    thread.join(120)
    assert built and built[0].runner.small_m_max_rows in (0, *SMALL_M_CANDIDATES)
    with open(lock, "rb") as held:  # released again: another worker can take it at once
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_co_located_workers_name_one_measurement_lock(tiny_llama_dir):
    """The core share's workers lock the same file; a worker on its own locks none."""
    model = str(tiny_llama_dir)
    shared = WorkerConfig(role="decode", model=model, num_threads=1, core_share="/tmp/x/cores")
    assert shared.engine_config().start_measurement_lock == "/tmp/x/cores.measure"
    assert WorkerConfig(role="decode", model=model).engine_config().start_measurement_lock == ""


def test_bf16_row_counts_reach_torch_rounded_to_the_bucket(monkeypatch):
    """oneDNN keeps a primitive (with its scratch, ~3 MB on SmolLM2) per row count for the life
    of the process: torch's bf16 matmul only ever sees row counts rounded up to ROW_BUCKET
    (zero rows added), and the caller gets its own rows back, equal to F.linear's."""
    import kernels.linear as linear_module

    seen: list[int] = []
    real = linear_module.F.linear

    def recording(x, w, b=None):
        seen.append(x.shape[0])
        return real(x, w, b)

    monkeypatch.setattr(linear_module.F, "linear", recording)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=generator).bfloat16()
    for rows in (17, 100, 611, 2047, 32):
        x = torch.randn(rows, 64, generator=generator).bfloat16()
        out = linear_module.linear(x, weight, None, 0)
        assert out.shape == (rows, 96)
        torch.testing.assert_close(out, real(x, weight), rtol=2e-2, atol=2e-2)
    assert seen == [32, 112, 624, 2048, 32]
    # float32 goes through MKL, which keeps no per-shape state: left as it is.
    seen.clear()
    linear_module.linear(torch.randn(17, 64), weight.float(), None, 0)
    assert seen == [17]
