"""The offline engine benchmark's method (bench/engine_throughput.py, bench/offline/): the
workload every system gets, the cold-prefix-cache rule checked against a real engine's
prefix_hits, the read-bandwidth floor, the phase loop and the report. vLLM does not run here (its
venv is built by `make peers`, not in CI): where its side is tested, a stand-in `LLM` object
returns outputs of vLLM's shape, said so at that test."""

from __future__ import annotations

import json
import statistics
from types import SimpleNamespace

import pytest
import torch

from bench import engine_throughput
from bench.offline import floor, phases, report, settings, vllm_child, vllm_runner
from bench.offline.splitserve_runner import SplitserveRunner, build_engine
from bench.offline.workload import FIRST_ID, Shape, Workload, make_workload, plan
from engine.config import ModelConfig

SMALL = Shape(num_requests=3, prompt_len=(20, 40), output_len=(2, 4), long_prompts=2, long_prompt_len=64,
              decode_prompt_len=16, decode_tokens=3, repeats=2, seed=0)


def _timed(work_plan: dict) -> list[Workload]:
    return [w for phase, works in work_plan.items() if phase != "warm-up" for w in works]


# -- workload ---------------------------------------------------------------------------------


def test_every_run_draws_its_own_prompts_so_none_shares_a_first_block():
    work_plan = plan(SMALL, vocab=1000)
    firsts = [tuple(r.prompt[:16]) for works in work_plan.values() for w in works for r in w.requests]
    assert len(firsts) == len(set(firsts))
    assert [len(work_plan[p]) for p in ("greedy", "sampled", "prefill")] == [2, 2, 2]
    assert len(work_plan["decode"]) == 4  # a 1-token and a (1 + n)-token run per repeat


def test_the_plan_is_the_same_for_the_same_seed_and_shape():
    assert plan(SMALL, 1000) == plan(SMALL, 1000)
    other = plan(Shape(**{**SMALL.__dict__, "seed": 1}), 1000)
    assert other["greedy"][0].requests[0].prompt != plan(SMALL, 1000)["greedy"][0].requests[0].prompt


def test_requests_have_exact_lengths_and_ids_clear_of_special_tokens():
    work = make_workload("w", 50, (5, 9), (3, 7), vocab=200, seed=3)
    assert all(5 <= len(r.prompt) <= 9 and 3 <= r.max_tokens <= 7 for r in work.requests)
    assert all(FIRST_ID <= t < 200 for r in work.requests for t in r.prompt)
    assert all(r.sampling_fields()["ignore_eos"] for r in work.requests)


def test_the_sampled_variant_is_top_p_at_0_8_with_penalties_and_logprobs_on_some():
    work = make_workload("s", 12, (5, 5), (4, 4), vocab=200, seed=0, sample=True)
    assert {(r.temperature, r.top_p) for r in work.requests} == {(0.8, 0.95)}
    penalised = [r for r in work.requests if r.repetition_penalty != 1.0]
    assert 0 < len(penalised) < 12 and all(r.presence_penalty and r.frequency_penalty for r in penalised)
    assert 0 < sum(r.logprobs == 5 for r in work.requests) < 12
    greedy = make_workload("g", 12, (5, 5), (4, 4), vocab=200, seed=0)
    assert {r.temperature for r in greedy.requests} == {0.0}


def test_the_vllm_child_gets_the_same_token_ids_through_json():
    work = make_workload("s", 5, (5, 9), (3, 7), vocab=200, seed=4, sample=True)
    assert Workload.from_json(json.loads(json.dumps(work.to_json()))) == work


# -- the cold-cache rule, on a real engine ----------------------------------------------------


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama_dir):
    vocab = ModelConfig.from_dir(tiny_llama_dir).vocab_size
    work_plan = plan(SMALL, vocab)
    return build_engine(str(tiny_llama_dir), threads=1, seed=0, plan=work_plan, dtype="float32"), work_plan


def test_every_repetition_starts_with_a_cold_prefix_cache(tiny_engine):
    engine, work_plan = tiny_engine
    before = engine.stats()["prefix_hits"]
    runs = phases.run_phases(SplitserveRunner(engine), work_plan, progress=lambda _: None,
                             sample=lambda: 1.0)
    assert engine.stats()["prefix_hits"] == before, "a timed run found cached prompt tokens"
    assert engine.stats()["prefix_queries"] > 0  # the cache was on and looked up
    assert [len(runs[p]) for p in phases.PHASES] == [4, 2, 2, 2]
    assert all(r["cached_tokens"] == 0 for rs in runs.values() for r in rs)


def test_a_repetition_that_reuses_its_prompts_is_refused(tiny_engine):
    engine, _ = tiny_engine
    work = make_workload("again", 2, (48, 48), (2, 2), engine.model_config.vocab_size, seed=99)
    runner = SplitserveRunner(engine)
    phases.timed_run(runner, work, sample=lambda: 1.0)
    hits = engine.stats()["prefix_hits"]
    with pytest.raises(phases.WarmCacheError, match="prefix cache"):
        phases.timed_run(runner, work, sample=lambda: 1.0)
    assert engine.stats()["prefix_hits"] > hits
    assert not engine.has_unfinished()


# -- the phase loop and the read-bandwidth floor ----------------------------------------------


class _Scripted:
    """A runner with given results, for the loop's own checks."""

    def __init__(self, *results):
        self.results = list(results)

    def run(self, work):
        return self.results.pop(0)


def test_the_bandwidth_is_sampled_before_and_after_each_timed_run():
    samples = iter([10.0, 20.0])
    work = make_workload("w", 1, (4, 4), (3, 3), 200, 0)
    row = phases.timed_run(_Scripted({"seconds": 1.0, "cpu_seconds": 1.0, "output_tokens": 3,
                                      "cached_tokens": 0}), work, sample=lambda: next(samples))
    assert (row["read_gbs_before"], row["read_gbs_after"]) == (10.0, 20.0)


def test_a_run_with_missing_output_tokens_is_an_error():
    work = make_workload("w", 1, (4, 4), (3, 3), 200, 0)
    with pytest.raises(RuntimeError, match="2 output tokens, expected 3"):
        phases.timed_run(_Scripted({"seconds": 1.0, "output_tokens": 2, "cached_tokens": 0}), work,
                         sample=lambda: 1.0)


def test_the_floor_is_weight_bytes_over_bytes_read_per_second():
    assert floor.bandwidth_gbs(2_000_000_000, 0.5) == 4.0
    assert floor.floor_ms(269_000_000, 43.7) == pytest.approx(6.156, abs=1e-3)
    with pytest.raises(ValueError):
        floor.floor_ms(1, 0.0)


def test_read_bandwidth_counts_the_bytes_of_one_pass(monkeypatch):
    ticks = iter(x * 0.5 for x in range(100))  # every sum "takes" 0.5 s
    monkeypatch.setattr(floor.time, "perf_counter", lambda: next(ticks))
    assert floor.read_bandwidth_gbs(nbytes=1 << 20, reps=3) == pytest.approx((1 << 20) / 0.5 / 1e9)


def test_tied_embeddings_count_once_in_the_weight_bytes():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    assert floor.weight_bytes(model) == 10 * 4 * 4


def _run(seconds, out=100, prompt=1000, gbs=(40.0, 40.0)):
    return {"seconds": seconds, "cpu_seconds": seconds * 2, "output_tokens": out, "prompt_tokens": prompt,
            "cached_tokens": 0, "read_gbs_before": gbs[0], "read_gbs_after": gbs[1], "load_average": 1.0}


def test_decode_ms_is_the_longer_run_minus_the_one_token_run_over_n():
    runs = {"decode": [_run(0.1), _run(0.1 + 10 * 0.008), _run(0.2), _run(0.2 + 10 * 0.006),
                       _run(0.1), _run(0.1 + 10 * 0.007)]}
    summary = phases.summarize(runs, decode_tokens=10)
    assert summary["decode"]["ms"] == pytest.approx(7.0)
    assert summary["decode"]["read_gbs"] == 40.0


def test_throughput_is_the_median_of_each_runs_own_rate():
    summary = phases.summarize({"greedy": [_run(1.0, out=100), _run(2.0, out=300), _run(4.0, out=200)],
                                "prefill": [_run(0.5, prompt=2048)]}, 1)
    assert summary["greedy"]["output_tok_s"] == statistics.median([100, 150, 50])
    assert summary["prefill"]["prompt_tok_s"] == 4096


# -- the report -------------------------------------------------------------------------------


def _system(greedy, prefill, decode_ms, gbs=40.0):
    runs = {"decode": [_run(0.1, gbs=(gbs, gbs)), _run(0.1 + decode_ms / 1e3, gbs=(gbs, gbs))],
            "greedy": [_run(100 / greedy)], "sampled": [_run(100 / greedy)],
            "prefill": [_run(1000 / prefill)]}
    return {"config": {"dtype": "bfloat16", "threads": 2}, "runs": runs, "summary": phases.summarize(runs, 1)}


def _report(prefill_ratio: float) -> dict:
    systems = {"splitserve": _system(600, 4000 * prefill_ratio, 7.0), "vllm": _system(400, 4000, 9.0)}
    wb = 268_800_000
    return {"config": {"threads": 2, "model": "m"}, "dtype": "bfloat16", "weight_bytes": wb,
            "workload": {"requests": 64, "prompt_len": [128, 512], "output_len": [64, 256], "long_prompts": 8,
                         "long_prompt_len": 2048, "decode_prompt_len": 128, "decode_tokens": 64, "repeats": 2},
            "systems": systems, "ratios": report.ratios(systems, wb),
            "settings": settings.run_settings(2, "bfloat16", list(systems), 1 << 30).to_json()}


def test_ratios_are_splitserve_over_vllm_with_the_prefill_target():
    r = _report(1.6)["ratios"]
    assert r["vllm"]["greedy"] == pytest.approx(1.5)
    assert r["vllm"]["prefill"] == pytest.approx(1.6)
    assert r["vllm"]["decode_ms"] == pytest.approx(7 / 9)
    assert r["decode_vs_read_floor"]["splitserve"] == pytest.approx(7.0 / floor.floor_ms(268_800_000, 40.0))
    text = "\n".join(report.lines(_report(1.6)))
    assert "prefill 1.60x (target >= 1.5x: met)" in text
    assert "(target >= 1.5x: missed)" in "\n".join(report.lines(_report(1.2)))


def test_the_headline_floor_is_the_read_floor_and_no_copy_floor_is_printed():
    text = "\n".join(report.lines(_report(1.6)))
    assert "read-bandwidth floor" in text and "6.72 ms" in text  # 268.8 MB / 40 GB/s
    assert "copy" not in text.lower()


def test_the_report_prints_every_systems_configuration_and_the_changes_from_defaults():
    text = "\n".join(report.lines(_report(1.6)))
    assert "splitserve: dtype=bfloat16, threads=2" in text and "vllm: dtype=bfloat16" in text
    for setting in ("VLLM_CPU_OMP_THREADS_BIND 0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU 0", "LD_PRELOAD",
                    "VLLM_CPU_KVCACHE_SPACE 4 GiB", "num_threads 2"):
        assert setting in text
    assert "kv_cache_memory" not in text  # the shipped budget was used: not an override
    assert "cold prefix cache" in text


# -- vLLM's side, without vLLM ----------------------------------------------------------------


def test_the_vllm_child_counts_tokens_and_cached_prefix_tokens():
    """vLLM cannot run in CI: a stand-in LLM returns RequestOutput-shaped objects."""
    seen = {}

    class FakeLLM:
        def generate(self, prompts, params, use_tqdm):
            seen["prompts"], seen["params"] = prompts, params
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1] * p["max_tokens"])],
                                    num_cached_tokens=16) for p in params]

    work = make_workload("w", 2, (20, 20), (3, 3), 200, 0, sample=True)
    runner = vllm_child.VLLMRunner(FakeLLM(), lambda **kw: kw)
    with pytest.raises(phases.WarmCacheError):
        phases.timed_run(runner, work, sample=lambda: 1.0)
    assert seen["prompts"][0] == {"prompt_token_ids": work.requests[0].prompt}
    assert seen["params"][0]["temperature"] == 0.8 and seen["params"][0]["ignore_eos"] is True


def test_vllm_runs_with_its_best_cpu_configuration(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    env = vllm_runner.child_env(2, tmp_path)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["LD_PRELOAD"].endswith("libiomp5.so") and env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert env["TORCHINDUCTOR_COMPILE_THREADS"] == "1"


def test_without_the_peer_venv_the_error_says_how_to_get_it(tmp_path):
    with pytest.raises(RuntimeError, match="make peers"):
        vllm_runner.run_vllm("m", "bfloat16", 2, 0, {}, phases.PHASES, venv=tmp_path / "absent")


def test_the_cli_defaults_and_bad_repeats():
    cfg = engine_throughput.parse_args(["--quick"])
    assert (cfg.shape.num_requests, cfg.shape.long_prompt_len, cfg.shape.repeats, cfg.threads) == (16, 2048, 2, 2)
    with pytest.raises(SystemExit):
        engine_throughput.parse_args(["--repeats", "0"])
