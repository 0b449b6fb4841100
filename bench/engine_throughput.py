"""Benchmark: offline throughput of the splitserve engine against vLLM's offline `LLM.generate`
(its own venv, a child process) and transformers `generate`, same prompts, same threads.

Run from the repo root:  .venv/bin/python bench/engine_throughput.py [--quick] [--skip-vllm]
Phases per system: batch-1 decode, greedy and sampled batches, prefill of long prompts; every
repetition draws fresh prompts (cold prefix cache). JSON to --out, figure beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(_ROOT))
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from bench.engine_plot import plot  # noqa: E402
from bench.offline import settings, vllm_runner  # noqa: E402
from bench.offline.floor import weight_bytes  # noqa: E402
from bench.offline.phases import PHASES, run_phases, summarize  # noqa: E402
from bench.offline.report import lines, ratios  # noqa: E402
from bench.offline.splitserve_runner import SplitserveRunner, build_engine  # noqa: E402
from bench.offline.workload import Shape, plan  # noqa: E402
from engine.config import ModelConfig, cpu_has_fast_bf16  # noqa: E402

DEFAULT_OUT = _ROOT / "bench" / "results" / "engine_throughput.json"


@dataclass(frozen=True)
class BenchConfig:
    model: str
    quick: bool
    shape: Shape
    hf_batch_size: int
    threads: int
    skip_vllm: bool
    skip_hf: bool
    out: str


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(_ROOT / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--quick", action="store_true",
                        help="16 requests, prompts 128-256, outputs 32-64, 2 long prompts")
    parser.add_argument("--num-requests", type=int)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per phase, each with fresh prompts")
    parser.add_argument("--long-prompts", type=int, help="prompts of --long-prompt-len in a prefill run")
    parser.add_argument("--long-prompt-len", type=int, default=2048)
    parser.add_argument("--hf-batch-size", type=int, help="static batch size for transformers generate")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-vllm", action="store_true", help="no vLLM (CI, or no `make peers`)")
    parser.add_argument("--skip-hf", action="store_true", help="no transformers")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    q = args.quick
    shape = Shape(num_requests=args.num_requests or (16 if q else 64),
                  prompt_len=(128, 256) if q else (128, 512), output_len=(32, 64) if q else (64, 256),
                  long_prompts=args.long_prompts or (2 if q else 8), long_prompt_len=args.long_prompt_len,
                  decode_prompt_len=128, decode_tokens=32 if q else 64, repeats=args.repeats, seed=args.seed)
    return BenchConfig(model=args.model, quick=q, shape=shape, hf_batch_size=args.hf_batch_size or (16 if q else 32),
                       threads=args.threads, skip_vllm=args.skip_vllm, skip_hf=args.skip_hf, out=args.out)


def progress(line: str) -> None:
    print(line, flush=True)


def run_splitserve(cfg: BenchConfig, work: dict) -> tuple[dict, int, str]:
    start = time.perf_counter()
    engine = build_engine(cfg.model, cfg.threads, cfg.shape.seed, work)
    dtype = str(engine.runner.dtype).removeprefix("torch.")
    progress(f"splitserve: engine ready in {time.perf_counter() - start:.1f}s ({dtype}, "
             f"{engine.kv.num_blocks} KV blocks)")
    runs = run_phases(SplitserveRunner(engine), work, PHASES, progress)
    system = {"config": settings.splitserve_config(engine), "runs": runs,
              "summary": summarize(runs, cfg.shape.decode_tokens)}
    return system, weight_bytes(engine.runner.model), dtype


def run_hf(cfg: BenchConfig, work: dict, dtype: str) -> dict:
    import transformers
    from transformers import AutoModelForCausalLM

    from bench.offline.hf_runner import HFGenerateRunner

    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=getattr(torch, dtype)).eval()
    greedy_only = {phase: [w for w in works if not any(r.temperature for r in w.requests)]
                   for phase, works in work.items() if phase != "sampled"}
    runs = run_phases(HFGenerateRunner(model, cfg.hf_batch_size), greedy_only,
                      ("decode", "greedy", "prefill"), progress)
    return {"config": {"version": transformers.__version__, "dtype": dtype, "threads": cfg.threads,
                       "batching": f"static batches of {cfg.hf_batch_size}, prompts padded left",
                       "sampled": "not run (no per-request penalties in one batch)"},
            "runs": runs, "summary": summarize(runs, cfg.shape.decode_tokens)}


def run_vllm(cfg: BenchConfig, work: dict, dtype: str) -> dict:
    progress("vLLM: start-up (compilation, not timed), then the same phases")
    out = vllm_runner.run_vllm(cfg.model, dtype, cfg.threads, cfg.shape.seed, work, PHASES)
    progress(f"vLLM {out['version']}: start-up took {out['startup_s']:.0f}s")
    return {"config": settings.vllm_config(out, dtype, cfg.threads), "runs": out["runs"],
            "summary": summarize(out["runs"], cfg.shape.decode_tokens)}


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_args(argv)
    torch.set_num_threads(cfg.threads)
    print(f"engine_throughput: {asdict(cfg)}", flush=True)
    work = plan(cfg.shape, ModelConfig.from_dir(cfg.model).vocab_size)
    systems: dict = {}
    systems["splitserve"], wbytes, dtype = run_splitserve(cfg, work)
    if not cfg.skip_vllm and not vllm_runner.available():
        progress(f"vLLM skipped: no peer venv at {vllm_runner.VLLM_VENV} (make peers builds it)")
    elif not cfg.skip_vllm:
        systems["vllm"] = run_vllm(cfg, work, dtype)
    if not cfg.skip_hf:
        systems["transformers"] = run_hf(cfg, work, dtype)
    s = cfg.shape
    report = {
        "config": {"model": cfg.model, "threads": cfg.threads, "quick": cfg.quick, "seed": s.seed},
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "torch": torch.__version__, "cpu_has_fast_bf16": cpu_has_fast_bf16()},
        "workload": {"requests": s.num_requests, "prompt_len": list(s.prompt_len),
                     "output_len": list(s.output_len), "long_prompts": s.long_prompts,
                     "long_prompt_len": s.long_prompt_len, "decode_prompt_len": s.decode_prompt_len,
                     "decode_tokens": s.decode_tokens, "repeats": s.repeats},
        "weight_bytes": wbytes, "dtype": dtype,
        "systems": systems, "ratios": ratios(systems, wbytes),
        "settings": settings.run_settings(cfg.threads, dtype, list(systems),
                                          systems["splitserve"]["config"]["kv_cache_memory"]).to_json(),
    }
    print("\n" + "\n".join(lines(report)), flush=True)
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}\nwrote {plot(report, out.with_suffix('.png'))}", flush=True)
    return report


if __name__ == "__main__":
    main()
