"""Benchmark: where an engine decode step's time goes, and so what asynchronous scheduling
could hide.

One LLMEngine as `make run` builds it (shipped dtype, 2 threads unless --threads), a batch of
requests with random-token prompts (as bench/engine_throughput.py and bench.compare send
them), decoding together. Per decode step it reports the whole step, the model forward (the
decoder layers; logits and sampling are outside it), the rest of execute_model (logits, the
sampler, input preparation) and what runs outside execute_model (the scheduler, the update,
the engine's bookkeeping). Asynchronous scheduling overlaps the scheduler and input
preparation of step N+1 with the forward of step N, so the last part and input preparation
bound what it can gain; sampling stays on the critical path.

    python bench/step_breakdown.py [--batches 1,32] [--temperatures 0,0.8]

--small-m-max-rows 64,8 builds one engine per value (the engine's cpu_small_m_max_rows: the most
rows the C++ small-M linear takes; "auto" is the shipped measurement at start) and measures
them side by side, alternating, --repeats times each, every run with fresh prompts.
--weight-layouts plain,packed,amx does the same for the engine's cpu_weight_layout (the linear
weights as loaded, packed for oneDNN or for the AMX kernel; "auto" is the shipped choice).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine import sampling_draw  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


def breakdown(engine: LLMEngine, batch: int, temperature: float, prompt_len: int,
              output_len: int, rng: random.Random) -> dict[str, float]:
    spent = {"forward": 0.0, "execute": 0.0}
    model = engine.runner.model
    forward, execute = model.forward, engine.runner.execute_model

    def timed(call, key: str):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - start
        return wrapper

    model.forward, engine.runner.execute_model = timed(forward, "forward"), timed(execute, "execute")
    try:
        tag = f"b{batch}-t{temperature}-{time.monotonic_ns()}"
        vocab = engine.model_config.vocab_size
        for i in range(batch):
            engine.add_request(f"{tag}-{i}", [rng.randrange(100, vocab) for _ in range(prompt_len)],
                               SamplingParams(max_tokens=output_len, temperature=temperature,
                                              top_p=0.95 if temperature else 1.0,
                                              ignore_eos=True, seed=i))
        for _ in range(3):  # the prefill and the first decode steps are not timed
            engine.step()
        spent["forward"] = spent["execute"] = 0.0
        steps, start = 0, time.perf_counter()
        while engine.has_unfinished():
            engine.step()
            steps += 1
        total = time.perf_counter() - start
    finally:
        del model.forward, engine.runner.execute_model
    ms = 1e3 / steps
    return {"step_ms": total * ms, "forward_ms": spent["forward"] * ms,
            "logits_sampling_prep_ms": (spent["execute"] - spent["forward"]) * ms,
            "scheduler_update_ms": (total - spent["execute"]) * ms}


def flat_draw_ms(vocab: int, rows: int = 32, repeats: int = 5) -> tuple[float, float, bool]:
    """The draw of `rows` flat rows (Gaussian logits, std 2, temperature 0.8, top_p 0.95: top-p
    keeps thousands of tokens) now, and as before the binned path: 64 candidates, then 1024,
    then a sort of the vocabulary. Milliseconds per call, and whether both drew the same."""
    from engine.sampling_params import SamplingParams

    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 2 / 0.8
    params = [SamplingParams(max_tokens=1, temperature=0.8, top_p=0.95, seed=i) for i in range(rows)]
    uniforms = [(i + 0.5) / rows for i in range(rows)]

    def before() -> list[int]:
        tokens, pending = [0] * rows, list(range(rows))
        for count in (64, 1024, vocab):
            if pending:
                pending = sampling_draw._draw_truncated(logits, params, uniforms, pending,
                                                        count, tokens)
        return tokens

    def now() -> list[int]:
        return sampling_draw.draw(logits, params, uniforms)

    def ms(call) -> float:
        call()
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        return (time.perf_counter() - start) / repeats * 1e3

    return ms(before), ms(now), before() == now()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--temperatures", default="0,0.8")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--small-m-max-rows", default="auto",
                        help="comma-separated: auto (measured at start, shipped) or 0-64")
    parser.add_argument("--weight-layouts", default="auto",
                        help="comma-separated: auto (shipped: amx where the CPU has AMX BF16, else "
                             "measured at start), amx, packed, plain")
    parser.add_argument("--repeats", type=int, default=1, help="runs per batch, alternating")
    args = parser.parse_args()
    engines = {}
    for value in args.small_m_max_rows.split(","):
        for layout in args.weight_layouts.split(","):
            engines[value, layout] = LLMEngine(EngineConfig(
                model=args.model, dtype="auto", device="cpu", num_threads=args.threads, seed=0,
                cpu_small_m_max_rows=-1 if value == "auto" else int(value),
                cpu_weight_layout=layout))
    engine = next(iter(engines.values()))
    rng = random.Random(0)
    print(f"engine decode step, {args.threads} threads, prompts {args.prompt_len} random "
          f"tokens, {args.output_len} output tokens, top_p 0.95 when sampled; each figure is "
          "the mean over one batch's decode steps")
    print("| small-M rows | weights | batch | temperature | step ms | forward ms | logits + "
          "sampling + input prep ms | scheduler + update ms | outside the forward |")
    print("|---|---|---|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        for temperature in (float(t) for t in args.temperatures.split(",")):
            for _ in range(args.repeats):
                for (value, layout), each in engines.items():
                    breakdown(each, batch, temperature, args.prompt_len, 16, rng)  # warm-up
                    r = breakdown(each, batch, temperature, args.prompt_len, args.output_len, rng)
                    outside = 1 - r["forward_ms"] / r["step_ms"]
                    rows = f"{value} ({each.runner.small_m_max_rows})" if value == "auto" else value
                    packed = each.runner.weight_layout
                    weights = f"{layout} ({packed})" if layout == "auto" else layout
                    print(f"| {rows} | {weights} | {batch} | {temperature:g} | {r['step_ms']:.2f} | "
                          f"{r['forward_ms']:.2f} | {r['logits_sampling_prep_ms']:.2f} | "
                          f"{r['scheduler_update_ms']:.2f} | {outside:.0%} |", flush=True)
    before, now, same = flat_draw_ms(engine.model_config.vocab_size)
    print(f"draw of 32 flat rows (top_p 0.95 keeps thousands of tokens): {before:.1f} ms with "
          f"the sort of the vocabulary, {now:.1f} ms binned; same tokens: {same}")


if __name__ == "__main__":
    main()
