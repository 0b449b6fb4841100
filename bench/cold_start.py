"""Worker cold start by phase: fresh worker processes, SmolLM2 and a larger random model, the
weight load set against the read-bandwidth floor of the same files measured in the same run.

    python -m bench.cold_start                        # 3 starts per role, model and cache state
    python -m bench.cold_start --runs 1 --roles both  # quicker

Each start is a new `splitserve worker` process (torch imported afresh, engine built, KV
allocated); its phases come from its ready line (services/common/startup.py). Two page-cache
states: `warm` (the checkpoint was read just before, as on a restart) and `evicted` (its pages
dropped with posix_fadvise before the start, as on a new node; no root needed, nothing else's
cache is touched). Before every start the same files are read once, timed, in the same state:
floor = weight bytes / that read's bandwidth, and the ratio weight_load / floor says how far
loading is from reading. Last, one start with an empty torch extensions folder shows what a
first start pays when the C++ CPU kernels were not built at install (`make install`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from engine.models.loader import safetensors_files
from services.common.startup import PHASES, parse_ready_fields
from splitserve_cli.processes import start_worker

REPO_ROOT = Path(__file__).resolve().parent.parent
SMOLLM2 = REPO_ROOT / "models" / "smollm2-135m-instruct"
CACHE_STATES = ("warm", "evicted")
# start_worker's one torch thread per worker (2 shared cores here); every other setting is the
# shipped default (dtype auto: bfloat16 on a CPU with AVX512_BF16).
SETTINGS = "--num-threads 1 (splitserve_cli.processes.start_worker); all else shipped defaults"


def build_random_llama(out: Path, num_layers: int, seed: int = 0) -> Path:
    """A Llama checkpoint of random bfloat16 weights (about 32 MB a layer plus 200 MB of
    embeddings) with SmolLM2's tokenizer; written once, reused while its config matches."""
    import torch
    from safetensors.torch import save_file

    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": "bfloat16",
        "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": num_layers,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64,
        "vocab_size": 49152, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
    }
    config_path = out / "config.json"
    if config_path.is_file() and json.loads(config_path.read_text()) == config:
        return out
    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    h, i, kv = config["hidden_size"], config["intermediate_size"], 8 * 64

    def rand(*shape):
        return (0.02 * torch.randn(*shape, generator=generator)).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": rand(config["vocab_size"], h),
               "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
               "lm_head.weight": rand(config["vocab_size"], h)}
    for n in range(num_layers):
        p = f"model.layers.{n}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, h),
            p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
            p + "mlp.down_proj.weight": rand(h, i),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SMOLLM2 / name, out / name)
    config_path.write_text(json.dumps(config, indent=2) + "\n")  # last: marks the folder done
    return out


def evict(files: list[Path]) -> None:
    """Drop these files' pages from the page cache (clean pages only; other files untouched)."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed_read(files: list[Path]) -> tuple[int, float]:
    """Bytes of `files` and the seconds a plain sequential read of them takes."""
    buffer = memoryview(bytearray(64 << 20))
    total = 0
    start = time.perf_counter()
    for file in files:
        with open(file, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total += n
    return total, time.perf_counter() - start


def one_start(role: str, model: Path, cache: str, env: dict | None = None) -> dict:
    files = safetensors_files(model)
    if cache == "evicted":
        evict(files)
    nbytes, read_s = timed_read(files)
    if cache == "evicted":
        evict(files)
    started = time.monotonic()
    worker = start_worker(role, model, "--metrics-port", "-1", timeout=600, env=env)
    seen_s = time.monotonic() - started
    try:
        line = next(line for line in worker.lines if line.startswith("SPLITSERVE_READY"))
        fields = dict(f.split("=", 1) for f in line.split()[3:] if "=" in f)
        phases = parse_ready_fields(fields)
    finally:
        worker.kill()
    floor_s = read_s  # weight bytes / (bytes / read_s)
    return {"role": role, "cache": cache, "phases": phases, "startup_s": float(fields["startup_s"]),
            "ready_seen_s": seen_s, "weight_bytes": nbytes, "read_s": read_s,
            "read_gb_s": nbytes / read_s / 1e9, "weight_load_over_floor": phases["weight_load"] / floor_s}


def median_row(runs: list[dict]) -> dict:
    row = {p: statistics.median(r["phases"][p] for r in runs) for p in PHASES}
    for key in ("startup_s", "read_gb_s", "read_s", "weight_load_over_floor"):
        row[key] = statistics.median(r[key] for r in runs)
    return row


def print_table(title: str, rows: list[tuple[str, dict]]) -> None:
    print(f"\n{title}  (median seconds per phase)")
    head = f"{'model / role / cache':34}" + "".join(f"{p:>14}" for p in PHASES)
    print(head + f"{'total':>9}{'read GB/s':>11}{'floor s':>9}{'load/floor':>11}")
    for label, r in rows:
        print(f"{label:34}" + "".join(f"{r[p]:14.3f}" for p in PHASES)
              + f"{r['startup_s']:9.2f}{r['read_gb_s']:11.2f}{r['read_s']:9.3f}"
              f"{r['weight_load_over_floor']:11.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="starts per model, role and cache")
    parser.add_argument("--roles", default="prefill,decode,both")
    parser.add_argument("--cache", default="warm,evicted", help="page-cache states to run")
    parser.add_argument("--random-layers", type=int, default=24,
                        help="layers of the random model (24: about 0.8 GB in bfloat16)")
    parser.add_argument("--random-dir", type=Path,
                        default=Path(tempfile.gettempdir()) / "splitserve-cold-start-llama")
    parser.add_argument("--skip-kernel-build", action="store_true",
                        help="skip the start with an empty torch extensions folder")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for the JSON (default bench/results/<date>-cold-start)")
    args = parser.parse_args(argv)
    # A SIGTERM unwinds like an exception, so the worker being timed is killed too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    roles = args.roles.split(",")
    caches = args.cache.split(",")
    if unknown := set(caches) - set(CACHE_STATES):
        parser.error(f"unknown cache state(s) {sorted(unknown)}; choose from {CACHE_STATES}")
    print(f"settings: {SETTINGS}", flush=True)
    print(f"building the random model ({args.random_layers} layers) in {args.random_dir} ...",
          flush=True)
    models = {"smollm2-135m": SMOLLM2,
              f"random-llama-{args.random_layers}l":
                  build_random_llama(args.random_dir, args.random_layers)}
    results: dict = {"settings": SETTINGS, "python": sys.version.split()[0], "runs": [],
                     "started": datetime.datetime.now(datetime.UTC).isoformat()}
    rows = []
    total = len(models) * len(roles) * len(caches) * args.runs
    done = 0
    for name, path in models.items():
        size = sum(f.stat().st_size for f in safetensors_files(path))
        print(f"\n{name}: {path} ({size / 1e6:.0f} MB of safetensors)", flush=True)
        for cache in caches:
            for role in roles:
                runs = []
                for _ in range(args.runs):
                    run = one_start(role, path, cache)
                    done += 1
                    runs.append(run)
                    results["runs"].append({"model": name, **run})
                    print(f"  [{done}/{total}] {role:7} {cache:7} ready in {run['startup_s']:6.2f}s "
                          + " ".join(f"{p}={run['phases'][p]:.2f}" for p in PHASES)
                          + f"  read {run['read_gb_s']:.2f} GB/s, load/floor "
                          f"{run['weight_load_over_floor']:.1f}", flush=True)
                rows.append((f"{name} / {role} / {cache}", median_row(runs)))
    print_table("worker start-up", rows)
    results["median"] = {label: row for label, row in rows}
    if not args.skip_kernel_build:
        with tempfile.TemporaryDirectory(prefix="splitserve-ext-") as empty:
            print("\none start with an empty TORCH_EXTENSIONS_DIR (kernels not built at install)"
                  " ...", flush=True)
            first = one_start("both", SMOLLM2, "warm", env={"TORCH_EXTENSIONS_DIR": empty})
            results["first_use_kernel_build"] = first
            print(f"  ready in {first['startup_s']:.2f}s, kernel_load "
                  f"{first['phases']['kernel_load']:.2f}s (built kernels: "
                  f"{statistics.median(r['phases']['kernel_load'] for r in results['runs']):.3f}s)",
                  flush=True)
    out = args.out or REPO_ROOT / "bench" / "results" / f"{datetime.date.today()}-cold-start"
    out.mkdir(parents=True, exist_ok=True)
    (out / "cold_start.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {out / 'cold_start.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
