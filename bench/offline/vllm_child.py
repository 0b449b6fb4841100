"""Runs inside vLLM's venv (bench/.peers/vllm/bin/python), started by vllm_runner.py:
    vllm_child.py SPEC.json RESULT.json
builds vLLM's offline `LLM` (start-up, ~90 s of compilation, is timed apart), then runs the
spec's plan through the same phase loop as the other systems, timing only `LLM.generate`."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.offline.phases import run_phases  # noqa: E402
from bench.offline.workload import Workload  # noqa: E402


class VLLMRunner:
    def __init__(self, llm, sampling_params_cls) -> None:
        self.llm, self.params = llm, sampling_params_cls

    def run(self, work: Workload) -> dict:
        prompts = [{"prompt_token_ids": r.prompt} for r in work.requests]
        params = [self.params(**r.sampling_fields()) for r in work.requests]
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "cpu_seconds": None,  # the work runs in vLLM's engine process
                "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
                "cached_tokens": sum(o.num_cached_tokens or 0 for o in outputs)}


def engine_settings(llm) -> dict:
    """What vLLM resolved its defaults to (best effort: the attribute paths move between releases)."""
    try:
        c = llm.llm_engine.vllm_config
    except AttributeError:
        return {}
    pick = {"dtype": lambda: str(c.model_config.dtype).removeprefix("torch."),
            "max_model_len": lambda: c.model_config.max_model_len,
            "max_num_batched_tokens": lambda: c.scheduler_config.max_num_batched_tokens,
            "max_num_seqs": lambda: c.scheduler_config.max_num_seqs,
            "chunked_prefill": lambda: c.scheduler_config.enable_chunked_prefill,
            "prefix_caching": lambda: c.cache_config.enable_prefix_caching,
            "block_size": lambda: c.cache_config.block_size}
    out = {}
    for key, get in pick.items():
        try:
            out[key] = get()
        except AttributeError:
            out[key] = None
    return out


def main(spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    import torch
    import vllm

    torch.set_num_threads(spec["threads"])  # this process only samples the bandwidth
    start = time.perf_counter()
    llm = vllm.LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
                   seed=spec["seed"])
    startup_s = time.perf_counter() - start
    print(f"vLLM ready in {startup_s:.1f}s", flush=True)
    plan = {phase: [Workload.from_json(w) for w in works] for phase, works in spec["plan"].items()}
    runs = run_phases(VLLMRunner(llm, vllm.SamplingParams), plan, spec["phases"],
                      progress=lambda line: print(line, flush=True))
    Path(result_path).write_text(json.dumps({"version": vllm.__version__, "startup_s": startup_s,
                                             "settings": engine_settings(llm), "runs": runs}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
