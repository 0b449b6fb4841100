"""Benchmark: CPU prefill in bfloat16, the C++ prefill attention against torch's SDPA, in the
same run: one attention layer on random inputs (SmolLM2's 9 query and 3 KV heads of 64), whole
and in 512-token chunks as a chunked prefill runs it, by SDPA, the C++ kernel's AVX-512 BF16
dot products and its AMX path (where the CPU has AMX); then a whole prompt through the engine
with `cpu_attention` torch and cpp (every repetition a new prompt: a cold prefix cache); then
a whole prompt through the shipped engine (every setting its default) against the same engine
cutting prompts alone into `long_prefill_token_threshold` chunks as it did before (the shipped
scheduler cuts only steps that carry decoding requests), the two alternating; then many
prompts prefilled in one step, their attention in one C++ call per layer
(prefill_attention_into) against one call per prompt as before, on one layer and through
the shipped engine, alternating; then prompts that add a few tokens to one cached prefix (a
system prompt, a chat's earlier turns) in one step of the shipped engine, whose attention
reads the whole cached context for each of them; then prompts sent together behind a new
shared prefix, which the shipped scheduler has computed once (the others wait a step for its
blocks) against every prompt computing it, alternating.

    python bench/prefill.py                     # SmolLM2, 1 thread, 512/1024/2048 tokens
    python bench/prefill.py --threads 2 --lengths 128,512
    python bench/prefill.py --threads 2 --lengths 1024,2048 --only chunking
    python bench/prefill.py --threads 2 --lengths 2048 --only profile
    python bench/prefill.py --threads 2 --only prompts --prompts 64x32,16x128
    python bench/prefill.py --threads 2 --only cached --cached 1x44+1280,16x44+1280
    python bench/prefill.py --threads 2 --only together --together 16x20+680
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import engine.models.llama as llama
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from kernels import cpu_kernels
from kernels.attention import prefill_attention
from kernels.linear import small_m_linear_available


def _best_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


_SALT = iter(range(10**6))


def _prefill(engine: LLMEngine, n: int) -> float:
    """One new n-token prompt (a cold prefix cache) through `engine` to its first token;
    returns the seconds it took."""
    s = next(_SALT)
    engine.add_request(f"r{s}", [100 + (i * 7 + 31 * s) % 20000 for i in range(n)],
                       SamplingParams(max_tokens=1, ignore_eos=True))
    start = time.perf_counter()
    while engine.scheduler.waiting or engine.scheduler.running:
        engine.step()
    return time.perf_counter() - start


def _step_ms(engine: LLMEngine, prompts: list[list[int]], tag: str) -> float:
    """Add `prompts` (one output token each) and time the engine's next step, which prefills
    them together; then run them out. Milliseconds of that step."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    start = time.perf_counter()
    engine.step()
    elapsed = time.perf_counter() - start
    while engine.has_unfinished():
        engine.step()
    return elapsed * 1e3


def attention_layer(lengths: list[int], repeats: int, chunk: int = 512) -> None:
    print(f"one attention layer, 9 query / 3 KV heads of 64, bf16, whole and in {chunk}-token "
          f"chunks (best of {repeats}):")
    paths = {"SDPA": prefill_attention,
             "C++ dot": lambda q, k, v, s: torch.ops.splitserve_cpu.prefill_attention(q, k, v, s, 0, False)}
    if torch.ops.splitserve_cpu.has_amx_bf16():
        paths["C++ AMX"] = lambda q, k, v, s: torch.ops.splitserve_cpu.prefill_attention(q, k, v, s, 0, True)
    for n in lengths:
        q, k, v = (torch.randn(n, heads, 64).bfloat16() for heads in (9, 3, 3))

        def chunks(attend, q=q, k=k, v=v, n=n):
            for end in range(min(chunk, n), n + 1, chunk):
                attend(q[end - chunk:end], k[:end], v[:end], 0.125)

        whole = {name: _best_ms(lambda f=f, q=q, k=k, v=v: f(q, k, v, 0.125), repeats)
                 for name, f in paths.items()}
        chunked = {name: _best_ms(lambda f=f: chunks(f), repeats) for name, f in paths.items()}
        # Causal: each of 9 heads multiplies n^2 / 2 query-key pairs of 64 dims twice (QK, PV).
        tflop = 9 * n * n / 2 * 64 * 4 / 1e12
        print(f"  {n:5d} tokens: " + "  ".join(
            f"{name} {whole[name]:6.2f} / {chunked[name]:6.2f} ms ({chunked['SDPA'] / chunked[name]:.2f}x, "
            f"{tflop / whole[name] * 1e3:.2f} TFLOP/s whole)"
            for name in paths) + "   (whole / chunked; x: SDPA's chunked time over this)")


def whole_prefill(model: str, lengths: list[int], repeats: int, threads: int) -> None:
    print(f"whole prefill through the engine ({model}, bf16, {threads} thread(s), best of "
          f"{repeats}, a new prompt each time):")
    engines = {choice: LLMEngine(EngineConfig(model=model, dtype="bfloat16", num_threads=threads,
                                              num_kv_blocks=1024, cpu_attention=choice))
               for choice in ("torch", "cpp")}
    for n in lengths:
        ms = {c: _best_ms(lambda e=e, n=n: _prefill(e, n), repeats) for c, e in engines.items()}
        print(f"  {n:5d} tokens: torch attention {ms['torch']:8.1f} ms  C++ {ms['cpp']:8.1f} ms  "
              f"({ms['torch'] / ms['cpp']:.2f}x; {n / ms['cpp'] * 1e3:.0f} tokens/s)")


def chunking(model: str, lengths: list[int], repeats: int, threads: int) -> None:
    """The shipped engine (prompts alone whole) against chunk_prompts_alone: same engine
    otherwise, runs alternating so both see the same machine state; a new prompt each run."""
    from dataclasses import replace

    base = EngineConfig(model=model, num_threads=threads, num_kv_blocks=1024)
    engines = {"whole": LLMEngine(base),
               "chunked": LLMEngine(replace(base, scheduler=replace(
                   base.scheduler, chunk_prompts_alone=True)))}
    chunk = base.scheduler.long_prefill_token_threshold
    print(f"a prompt alone through the engine ({model}, shipped dtype "
          f"{engines['whole'].runner.dtype}, {threads} thread(s), best of {repeats}, "
          f"alternating): whole (shipped) against {chunk}-token chunks (chunk_prompts_alone):")
    for n in lengths:
        for engine in engines.values():
            _prefill(engine, n)  # warm
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(repeats):
            for name, engine in engines.items():
                times[name].append(_prefill(engine, n))
        whole, chunked = (min(times[name]) * 1e3 for name in ("whole", "chunked"))
        print(f"  {n:5d} tokens: whole {whole:8.1f} ms  chunked {chunked:8.1f} ms  "
              f"(chunked / whole {chunked / whole:.2f}x)")


def many_prompts(model: str, shapes: list[tuple[int, int]], repeats: int, threads: int) -> None:
    """`count` prompts of `length` tokens in one step: their attention in one C++ call per layer
    (prefill_attention_into, shipped) against one call per prompt (the path before it), on one
    attention layer and through the shipped engine. The engine's per-prompt runs take the old
    path by giving the runner no fresh-prompt spans; both alternate, new prompts every run."""
    import statistics

    print(f"many prompts in one step, one attention call per layer (shipped) against one per "
          f"prompt ({threads} thread(s)):")
    for count, length in shapes:
        n = count * length
        q, k, v = (torch.randn(n, heads, 64).bfloat16() for heads in (9, 3, 3))
        spans = torch.tensor([(i * length, length) for i in range(count)], dtype=torch.long)

        def per_prompt(q=q, k=k, v=v, count=count, length=length):
            out = torch.empty_like(q)
            for start in range(0, count * length, length):
                end = start + length
                out[start:end] = torch.ops.splitserve_cpu.prefill_attention(
                    q[start:end], k[start:end], v[start:end], 0.125, 0)

        def one_call(q=q, k=k, v=v, spans=spans):
            torch.ops.splitserve_cpu.prefill_attention_into(torch.empty_like(q), q, k, v, spans,
                                                            0.125, 0)

        each, one = (_best_ms(f, max(5, repeats)) for f in (per_prompt, one_call))
        print(f"  {count} x {length} tokens, one layer: per prompt {each:.3f} ms, one call "
              f"{one:.3f} ms ({each / one:.2f}x; best of {max(5, repeats)})")
    engine = LLMEngine(EngineConfig(model=model, num_threads=threads, num_kv_blocks=2048))
    if not engine.runner.native_prefill:
        print("  the engine does not run the C++ prefill attention here: no engine figures")
        return
    shipped = engine.runner._fresh_prefill_spans
    vocab = engine.model_config.vocab_size
    salt = iter(range(10**6))

    def step_ms(count: int, length: int) -> float:
        s = next(salt)
        return _step_ms(engine, [[100 + (j * 7 + 131 * s + 977 * i) % (vocab - 100)
                                  for j in range(length)] for i in range(count)], f"p{s}")

    for count, length in shapes:
        times: dict[str, list[float]] = {"one call": [], "per prompt": []}
        for r in range(2 * repeats + 1):
            order = ("one call", "per prompt") if r % 2 else ("per prompt", "one call")
            for name in order:
                engine.runner._fresh_prefill_spans = (shipped if name == "one call"
                                                      else lambda seqs: None)
                ms = step_ms(count, length)
                if r:  # the first round warms both
                    times[name].append(ms)
        engine.runner._fresh_prefill_spans = shipped
        one, each = (statistics.median(times[name]) for name in ("one call", "per prompt"))
        print(f"  {count} x {length} tokens, the engine's step: per prompt {each:.0f} ms, one "
              f"call {one:.0f} ms ({each / one:.3f}x; medians of {2 * repeats}, alternating)")


def cached_prefix(model: str, shapes: list[tuple[int, int, int]], repeats: int, threads: int) -> None:
    """`count` prompts that each add `new` tokens to one `prefix`-token prefix, cached by a
    request before them: one step of the shipped engine, the median of `repeats` steps (each
    with new suffixes; the prefix stays cached), and the share of it in attention."""
    import statistics

    engine = LLMEngine(EngineConfig(model=model, num_threads=threads, num_kv_blocks=2048))
    while engine.prefault_kv():  # as a serving worker has done before its first request
        pass
    vocab = engine.model_config.vocab_size
    salt = iter(range(10**6))
    spent = [0.0]
    attend = llama.paged_attention

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return attend(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    print(f"prompts after one cached prefix, one step of the shipped engine ({threads} "
          f"thread(s), median of {repeats}):")
    llama.paged_attention = timed
    try:
        for count, new, prefix_len in shapes:
            prefix = [100 + (j * 31 + 7 * prefix_len) % (vocab - 100) for j in range(prefix_len)]
            engine.add_request(f"prefix{next(salt)}", prefix, SamplingParams(max_tokens=1, ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
            steps, shares = [], []
            for _ in range(repeats + 1):
                s = next(salt)
                spent[0] = 0.0
                steps.append(_step_ms(engine, [prefix + [100 + (j * 7 + 131 * s + 977 * i) % (vocab - 100)
                                                         for j in range(new)] for i in range(count)],
                                      f"c{s}"))
                shares.append(spent[0] * 1e3 / steps[-1])
            step, share = statistics.median(steps[1:]), statistics.median(shares[1:])
            print(f"  {count} x ({prefix_len} cached + {new} new tokens): step {step:.0f} ms, "
                  f"attention {share:.0%} of it")
    finally:
        llama.paged_attention = attend


def prompts_together(model: str, shapes: list[tuple[int, int, int]], repeats: int,
                     threads: int) -> None:
    """`count` prompts added at once, each a new shared prefix (no block of it cached) plus
    its own tokens, through the shipped engine (the later prompts wait a step for the first's
    prefix blocks: wait_for_shared_blocks) against the same engine where every prompt the
    token budget takes computes the prefix itself, as before; alternating, a new prefix
    every repetition (a cold cache). Milliseconds from adding them to each first token."""
    from dataclasses import replace

    base = EngineConfig(model=model, num_threads=threads, num_kv_blocks=4096)
    engines = {"shipped": LLMEngine(base),
               "each computes it": LLMEngine(replace(base, scheduler=replace(
                   base.scheduler, wait_for_shared_blocks=False)))}
    vocab = engines["shipped"].runner.model_config.vocab_size
    salt = iter(range(10**6))

    def firsts(engine: LLMEngine, count: int, new: int, prefix_len: int) -> list[float]:
        s = next(salt)
        prefix = [100 + (j * 13 + 7919 * s) % (vocab - 100) for j in range(prefix_len)]
        start, seen = time.perf_counter(), {}
        for i in range(count):
            engine.add_request(f"t{s}-{i}", prefix + [100 + (j * 7 + 977 * i + s) % (vocab - 100)
                                                      for j in range(new)],
                               SamplingParams(max_tokens=1, ignore_eos=True))
        while engine.has_unfinished():
            for out in engine.step():
                seen.setdefault(out.request_id, (time.perf_counter() - start) * 1e3)
        return sorted(seen.values())

    print(f"prompts sent together behind a new shared prefix, through the engine ({threads} "
          f"thread(s), median of {repeats}, alternating): first tokens, first / median / last "
          "ms")
    for count, new, prefix_len in shapes:
        runs: dict[str, list[list[float]]] = {name: [] for name in engines}
        for _ in range(repeats + 1):  # the first round warms both
            for name, engine in engines.items():
                runs[name].append(firsts(engine, count, new, prefix_len))
        cells = []
        for name, got in runs.items():
            first, mid, last = (statistics.median(run[k] for run in got[1:])
                                for k in (0, count // 2, count - 1))
            cells.append(f"{name} {first:5.0f} / {mid:5.0f} / {last:5.0f}")
        ratio = (statistics.median(r[-1] for r in runs["each computes it"][1:])
                 / statistics.median(r[-1] for r in runs["shipped"][1:]))
        print(f"  {count} x ({prefix_len} shared + {new} own): " + "   ".join(cells)
              + f"   (last: {ratio:.2f}x sooner shipped)")


def profile_prompt(model: str, n: int, threads: int) -> None:
    """One n-token prompt alone through the shipped engine under torch.profiler (after three
    unprofiled ones, each a new prompt): where a prefill step's time goes, by operator."""
    from torch.profiler import ProfilerActivity, profile

    engine = LLMEngine(EngineConfig(model=model, num_threads=threads, num_kv_blocks=1024))
    for _ in range(3):
        _prefill(engine, n)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _prefill(engine, n)
    print(f"one {n}-token prompt through the shipped engine ({threads} thread(s)), by operator "
          "(torch.profiler, self CPU time):")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))


def _prefix_shapes(text: str) -> list[tuple[int, int, int]]:
    """"COUNTxNEW+PREFIX,..." -> [(count, new tokens, prefix tokens), ...]."""
    shapes = []
    for shape in text.split(","):
        count_new, prefix_len = shape.split("+")
        count, new = count_new.split("x")
        shapes.append((int(count), int(new), int(prefix_len)))
    return shapes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/smollm2-135m-instruct")
    parser.add_argument("--lengths", default="512,1024,2048")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", default="64x32,16x128",
                        help="COUNTxLENGTH,...: the many-prompts part's steps")
    parser.add_argument("--cached", default="1x44+1280,16x44+1280",
                        help="COUNTxNEW+PREFIX,...: the cached-prefix part's steps")
    parser.add_argument("--together", default="16x20+680,4x20+680,2x8+64",
                        help="COUNTxOWN+PREFIX,...: prompts sent together behind a new prefix")
    parser.add_argument("--only", choices=("attention", "engine", "chunking", "profile", "prompts",
                                           "cached", "together"),
                        default=None,
                        help="run one part: the attention layer, the engine's attention "
                             "choices, whole against chunked prompts, a profile of the "
                             "longest length's prefill by operator, many prompts in a step, or "
                             "prompts after a cached prefix, or prompts sent together behind "
                             "a new one")
    args = parser.parse_args(argv)
    if not (cpu_kernels.load() and small_m_linear_available()):
        raise SystemExit("needs the C++ CPU kernels and a CPU with avx512_bf16")
    from engine.config import cpu_has_fast_bf16

    print("settings: the attention and engine parts force dtype bfloat16 (the C++ prefill "
          "attention is bfloat16 only; the shipped --dtype auto is "
          f"{'bfloat16' if cpu_has_fast_bf16() else 'float32'} on this CPU) and set "
          "cpu_attention torch against cpp; the chunking, prompts, cached and together parts run every shipped default "
          "(prompts: its per-prompt runs take the attention path before prefill_attention_into); "
          f"{args.threads} torch thread(s)")
    torch.set_num_threads(args.threads)
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.only in (None, "attention"):
        attention_layer(lengths, max(5, args.repeats))
    if args.only in (None, "engine"):
        whole_prefill(args.model, lengths, args.repeats, args.threads)
    if args.only in (None, "chunking"):
        chunking(args.model, lengths, args.repeats, args.threads)
    if args.only in (None, "profile"):
        profile_prompt(args.model, max(lengths), args.threads)
    if args.only in (None, "prompts"):
        shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.prompts.split(",")]
        many_prompts(args.model, shapes, args.repeats, args.threads)
    if args.only in (None, "cached"):
        cached_prefix(args.model, _prefix_shapes(args.cached), args.repeats, args.threads)
    if args.only in (None, "together"):
        prompts_together(args.model, _prefix_shapes(args.together), args.repeats, args.threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
