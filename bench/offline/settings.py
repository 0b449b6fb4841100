"""What each system ran with, and what this bench changed from what each ships (bench/
run_settings.py prints it): splitserve as `make run` builds its engine, vLLM in its best CPU
configuration here, transformers in the same dtype and threads."""

from __future__ import annotations

from bench.compare.vllm_peer import KVCACHE_SPACE_GIB, MAX_MODEL_LEN, VLLM_VENV, libiomp
from bench.run_settings import Override, RunSettings
from engine.config import EngineConfig

COLD_NOTE = ("every repetition draws fresh prompts (its own seed), so it starts with a cold prefix "
             "cache; no cache is reset, and a timed run that finds a cached prompt token is refused "
             "(splitserve's prefix_hits, vLLM's num_cached_tokens). Start-up (vLLM's compilation, "
             "1-2.5 min) and one warm-up of each kind are excluded; only generation is timed")


def splitserve_config(engine) -> dict:
    c, s = engine.config, engine.config.scheduler
    return {"dtype": f"{c.dtype} -> {str(engine.runner.dtype).removeprefix('torch.')}",
            "threads": c.num_threads, "kv_cache_memory": c.kv_cache_memory, "max_num_batched_tokens": s.max_num_batched_tokens,
            "max_num_seqs": s.max_num_seqs, "chunked_prefill": s.enable_chunked_prefill,
            "long_prefill_token_threshold": s.long_prefill_token_threshold,
            "prefix_caching": c.enable_prefix_caching, "block_size": c.block_size,
            "kv_blocks": engine.kv.num_blocks, "cpu_attention": c.cpu_attention,
            "cpu_linear": c.cpu_linear, "cpu_fused_decode": c.cpu_fused_decode,
            "cpu_weight_layout": f"{c.cpu_weight_layout} -> {engine.runner.weight_layout}",
            "small_m_max_rows": engine.runner.small_m_max_rows,
            "prefill_attention": engine.runner.kernel_paths.prefill_attention}


def vllm_config(child: dict, dtype: str, threads: int) -> dict:
    bind = f"0-{threads - 1}" if threads > 1 else "0"
    return {"version": child["version"], **child["settings"], "requested_dtype": dtype,
            "omp_threads_bind": bind, "reserved_cpus": 0, "kvcache_space_gib": KVCACHE_SPACE_GIB,
            "openmp": "libiomp5 (LD_PRELOAD)", "startup_s": round(child["startup_s"], 1)}


def run_settings(threads: int, dtype: str, systems: list[str], kv_cache_memory: int) -> RunSettings:
    default_kv = EngineConfig(model="").kv_cache_memory
    overrides = [] if kv_cache_memory == default_kv else [
        Override("workers", "kv_cache_memory", str(kv_cache_memory), str(default_kv),
                 "room for the largest run at full length: no run preempts (vLLM has 4 GiB)")]
    overrides += [
        Override("workers", "num_threads", str(threads), "None (splitserve up splits the cores between "
                 "its processes)", f"one engine in this process gets all {threads} cores, as vLLM does"),
    ]
    if "vllm" in systems:
        iomp = libiomp(VLLM_VENV).name if VLLM_VENV.exists() else "libiomp5.so"
        bind = f"0-{threads - 1}" if threads > 1 else "0"
        overrides += [
            Override("peer", "vLLM dtype", dtype, "auto", "splitserve's shipped dtype here, the same for every system"),
            Override("peer", "vLLM max_model_len", str(MAX_MODEL_LEN), "8192 (the model's)",
                     "as bench.compare serves it; every prompt here fits"),
            Override("peer", "VLLM_CPU_OMP_THREADS_BIND", bind, "auto (one core bound, one reserved)",
                     f"its fastest on this machine: {threads} threads, like splitserve"),
            Override("peer", "VLLM_CPU_NUM_OF_RESERVED_CPU", "0", "unset", "no core left idle"),
            Override("peer", "VLLM_CPU_KVCACHE_SPACE", f"{KVCACHE_SPACE_GIB} GiB", "unset (vLLM sizes it)",
                     "bench.compare's setting; room for every run"),
            Override("peer", "LD_PRELOAD", iomp, "unset (GNU OpenMP)", "Intel OpenMP is faster for vLLM here"),
            Override("bench", "TORCHINDUCTOR_COMPILE_THREADS", "1", "unset (one per core)",
                     "shared machine; slows vLLM's untimed start-up only"),
        ]
    if "transformers" in systems:
        overrides.append(Override("peer", "transformers dtype", dtype, "the checkpoint's (float32)",
                                  "the same dtype for every system"))
    return RunSettings(bench="engine_throughput", overrides=tuple(overrides), gateway=False, note=COLD_NOTE)
