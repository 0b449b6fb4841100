"""`splitserve profile`: measure what one worker does on this machine and write the JSON
profile the autoscaler, `splitserve capacity plan` and the simulator read."""

from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=os.environ.get("SPLITSERVE_MODEL",
                                                          "models/smollm2-135m-instruct"))
    parser.add_argument("--out", default="profile.json", help="where to write the JSON profile")
    parser.add_argument("--quick", action="store_true",
                        help="fewer points and repeats (about a minute for SmolLM2 on CPU)")
    parser.add_argument("--num-threads", type=int, default=1,
                        help="torch threads, as the workers will run (local workers use 1)")
    parser.add_argument("--kv-cache-memory", default="1GiB",
                        help="the workers' --kv-cache-memory (sets the profile's KV blocks)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--long-prefill-token-threshold", type=int, default=512)
    parser.add_argument("--no-worker-start", action="store_true",
                        help="skip timing a real worker process from spawn to READY")
    parser.add_argument("--without-contention", action="store_true",
                        help="write each point divided by the CPU contention it met (from the "
                             "kernel's schedstat): for sizing replicas that will own their cores "
                             "from a measurement on a shared host")
    parser.add_argument("--colocated", type=int, nargs="?", const=1, default=0, metavar="BATCH",
                        help="time every point while a real decode worker on this host streams "
                             "BATCH (default 1) generations to a client: for a prefill and a "
                             "decode worker that will share this machine's cores")


def run(args: argparse.Namespace) -> int:
    from services.autoscaler.profiler import ProfileSettings, measure_profile

    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise SystemExit(f"splitserve profile: --model {args.model!r} is not a model folder")
    settings = ProfileSettings(
        model=args.model, num_threads=args.num_threads, kv_cache_memory=args.kv_cache_memory,
        block_size=args.block_size, dtype=args.dtype, device=args.device,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        long_prefill_token_threshold=args.long_prefill_token_threshold, quick=args.quick,
        measure_worker_start=not args.no_worker_start, repeats=2 if args.quick else 3,
        colocated_batch=args.colocated,
    )
    profile = measure_profile(settings)
    if args.without_contention:
        profile = profile.without_contention()
    profile.save(args.out)
    print(f"wrote {args.out}")
    return 0
