"""The worker's command line: a flag per WorkerConfig field (each defaulting to its
SPLITSERVE_<FIELD> environment variable) and the WorkerConfig built from them."""

from __future__ import annotations

import argparse
import os

from kernels.attention import ATTENTION_BACKENDS
from services.common.core_share import DEFAULT_YIELD_BURST_S, DEFAULT_YIELD_SHARE
from services.common.engine_loop import DEFAULT_KV_RESERVATION_TTL_S, DEFAULT_MAX_UNREAD_OUTPUTS
from services.common.worker_config import ROLES, WorkerConfig


def _env(name: str, default):
    return os.environ.get(f"SPLITSERVE_{name.upper()}", default)


def add_worker_arguments(parser: argparse.ArgumentParser, role: str | None) -> None:
    """Flags for every WorkerConfig field; each defaults to SPLITSERVE_<FIELD> if set."""
    if role is None:
        parser.add_argument("--role", choices=ROLES, default=_env("role", "both"))
    parser.add_argument("--model", default=_env("model", "models/smollm2-135m-instruct"))
    parser.add_argument("--served-model-name", default=_env("served_model_name", ""),
                        help="what clients call the model: the --openai-port's name and the "
                             "metrics' model label (empty: the model folder's name, which stays "
                             "the worker's identity in the registry, by which versions pair)")
    parser.add_argument("--host", default=_env("host", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(_env("port", 50051)))
    parser.add_argument("--kv-port", type=int, default=int(_env("kv_port", 0)))
    parser.add_argument("--worker-id", default=_env("worker_id", ""))
    parser.add_argument("--dtype", default=_env("dtype", "auto"))
    parser.add_argument("--device", default=_env("device", "auto"))
    parser.add_argument("--block-size", type=int, default=int(_env("block_size", 16)))
    parser.add_argument("--kv-cache-memory", default=_env("kv_cache_memory", "auto"),
                        help="KV pool size (e.g. 4GiB); auto: after a profile step, on GPU "
                             "from --gpu-memory-utilization, on CPU half of MemAvailable past "
                             "the step's peak, at most 1GiB")
    parser.add_argument("--gpu-memory-utilization", type=float,
                        default=float(_env("gpu_memory_utilization", 0.9)),
                        help="GPU, --kv-cache-memory auto: fraction of the device's memory "
                             "this worker may hold (weights, step peak, KV pool)")
    parser.add_argument("--num-kv-blocks", type=int, default=int(_env("num_kv_blocks", 0)))
    parser.add_argument("--max-model-len", type=int, default=int(_env("max_model_len", 0)))
    parser.add_argument("--max-num-batched-tokens", type=int,
                        default=int(_env("max_num_batched_tokens", 2048)))
    parser.add_argument("--max-num-seqs", type=int, default=int(_env("max_num_seqs", 128)))
    parser.add_argument("--long-prefill-token-threshold", type=int,
                        default=int(_env("long_prefill_token_threshold", 512)))
    parser.add_argument("--itl-target-ms", type=float,
                        default=float(_env("itl_target_ms", -1)),
                        help="a step that carries decoding requests takes only the prompt "
                             "tokens (prefill chunks) measured to fit this many milliseconds, "
                             "so that one long prompt does not stall every stream; 0: off "
                             "(the token budgets alone decide); default -1: 150 on a decode "
                             "worker, 0 otherwise")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        default=_env("no_prefix_caching", "") not in ("", "0"))
    parser.add_argument("--num-threads", type=int, default=int(_env("num_threads", 0)),
                        help="torch threads per process (per rank with tensor parallelism)")
    parser.add_argument("--small-step-threads", type=int,
                        default=int(_env("small_step_threads", 0)),
                        help="torch threads for steps of at most 16 tokens (small decode batches, "
                             "whose threads wait on each other when the cores are shared with "
                             "other work); 0 (default): all of --num-threads for every step")
    parser.add_argument("--tensor-parallel-size", type=int,
                        default=int(_env("tensor_parallel_size", 1)),
                        help="split the model across this many ranks, one process each "
                             "(NCCL on GPU, gloo on CPU); prefill and decode must match")
    parser.add_argument("--attention-backend", choices=ATTENTION_BACKENDS,
                        default=_env("attention_backend", "auto"),
                        help="attention kernels: triton (kernels/triton, CUDA), torch (the "
                             "reference), auto: triton on CUDA when it imports")
    parser.add_argument("--enforce-eager", action="store_true",
                        default=_env("enforce_eager", "") not in ("", "0", "false"),
                        help="CUDA: run every step eagerly (no CUDA graphs for decode steps)")
    parser.add_argument("--cuda-graph-max-batch", type=int,
                        default=int(_env("cuda_graph_max_batch", 0)),
                        help="CUDA: capture decode graphs for batches up to this many requests "
                             "(0: --max-num-seqs); larger decode steps run eagerly")
    parser.add_argument("--cuda-graph-max-context", type=int,
                        default=int(_env("cuda_graph_max_context", 0)),
                        help="CUDA: decode graphs cover contexts up to this many tokens (0: "
                             "8192, at most --max-model-len); longer ones run eagerly")
    parser.add_argument("--cpu-small-m-max-rows", type=int,
                        default=int(_env("cpu_small_m_max_rows", -1)),
                        help="CPU bf16: most rows the C++ small-M linear takes (0-64; torch's mm "
                             "above); -1: measured at start against torch's mm on this host")
    parser.add_argument("--cpu-weight-layout", choices=("auto", "amx", "packed", "plain"),
                        default=_env("cpu_weight_layout", "auto"),
                        help="CPU bf16: a second copy of the linear weights for faster decode "
                             "batches, in the AMX kernel's tile layout ('amx') or oneDNN's "
                             "blocked layout ('packed'); 'plain': none; 'auto': amx where the CPU "
                             "has AMX BF16, else packed if it wins at start on this host, and "
                             "only if the copy takes at most a quarter of the available memory")
    parser.add_argument("--cpu-shared-prefix-attention", choices=("on", "off"),
                        default=_env("cpu_shared_prefix_attention", "on"),
                        help="CPU C++ decode attention: decode rows whose contexts begin with the "
                             "same cached blocks (a shared system prompt) attend that prefix once "
                             "for all of them; 'off': every row reads its own")
    parser.add_argument("--structured-outputs-warmup", choices=("on", "off"),
                        default=_env("structured_outputs_warmup", "on"),
                        help="build the grammar tokenizer and mask threads while first idle "
                             "(about 0.3 s and 54 MiB on SmolLM2), so the first request under a "
                             "structured output does not wait for them; 'off': on that request")
    parser.add_argument("--cpu-kv-prefault-tokens", type=int,
                        default=int(_env("cpu_kv_prefault_tokens", -1)),
                        help="CPU: while idle, fault in the KV pool's pages this many tokens "
                             "ahead of the blocks in use, so steps do not pay for first "
                             "touches; -1 (default): 4x --max-num-batched-tokens; 0: off")
    parser.add_argument("--kv-wait-timeout-s", type=float, default=float(_env("kv_wait_timeout_s", 60)))
    parser.add_argument("--kv-transfer-timeout-s", type=float,
                        default=float(_env("kv_transfer_timeout_s", 30)))
    parser.add_argument("--kv-reservation-ttl-s", type=float,
                        default=float(_env("kv_reservation_ttl_s", DEFAULT_KV_RESERVATION_TTL_S)),
                        help="decode: the longest a request may wait for remote KV, whatever "
                             "else happens; then it is recomputed locally if its stream is "
                             "open, freed if not")
    parser.add_argument("--max-unread-outputs", type=int,
                        default=int(_env("max_unread_outputs", DEFAULT_MAX_UNREAD_OUTPUTS)),
                        help="outputs (one per step) a request may have waiting for its "
                             "reader; past it the reader has stopped reading and the request "
                             "is aborted, its KV freed and its stream ended with an error")
    parser.add_argument("--step-timeout-s", type=float, default=float(_env("step_timeout_s", 60)),
                        help="an engine step (or a KV wait inside it) running longer than this "
                             "makes the worker not ready (/ready, Health) until it ends; 0: off")
    parser.add_argument("--core-share", default=_env("core_share", ""),
                        help="a file the workers of this host map to lend each other their "
                             "--num-threads while idle (splitserve up --mode disagg sets it); "
                             "empty: off")
    parser.add_argument("--core-share-yield", type=float,
                        default=float(_env("core_share_yield", DEFAULT_YIELD_SHARE)),
                        help="with --core-share, a worker that does not prefill pauses while a "
                             "co-located prefill worker steps, so prompts run on every core, "
                             "for at most this share of its time (and --core-share-yield-burst-s "
                             "at once); 0: never")
    parser.add_argument("--core-share-yield-burst-s", type=float,
                        default=float(_env("core_share_yield_burst_s", DEFAULT_YIELD_BURST_S)),
                        help="with --core-share-yield, the longest a decode worker pauses for "
                             "prompts at once (the credit's cap; a pause also waits out the "
                             f"prefill step it let run); default {DEFAULT_YIELD_BURST_S:g}")
    parser.add_argument("--speculative-method", default=_env("speculative_method", ""),
                        help="decode: speculative decoding, 'ngram' (prompt lookup) or "
                             "'draft' (a smaller model); off when empty")
    parser.add_argument("--num-speculative-tokens", type=int,
                        default=int(_env("num_speculative_tokens", 4)),
                        help="decode: most tokens proposed per request and step; lowered per "
                             "request by measured acceptance")
    parser.add_argument("--draft-model", default=_env("draft_model", ""),
                        help="decode: draft model folder (same tokenizer as --model) for "
                             "--speculative-method draft")
    parser.add_argument("--speculative-max-batch-size", type=int,
                        default=int(_env("speculative_max_batch_size", 0)),
                        help="decode: no speculation while more requests decode than this "
                             "(0: speculate where measured throughput says it pays)")
    parser.add_argument("--metrics-port", type=int, default=int(_env("metrics_port", 0)),
                        help="HTTP port for /metrics, /health, /ready (0: free port, -1: off)")
    parser.add_argument("--vllm-metrics", action=argparse.BooleanOptionalAction,
                        default=_env("vllm_metrics", "1") not in ("", "0", "false"),
                        help="also export the metrics under vLLM's names (vllm:*, label "
                             "model_name) for vLLM dashboards and endpoint pickers")
    parser.add_argument("--openai-port", type=int, default=int(_env("openai_port", 0)),
                        help="role both: serve the OpenAI API (/v1/completions, "
                             "/v1/chat/completions, /v1/models; /health, /metrics) on this "
                             "port, for this worker alone, e.g. behind an endpoint picker "
                             "(0: off)")
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", _env("redis_url", "")),
                        help="register with heartbeats in this Redis (env REDIS_URL)")
    parser.add_argument("--advertise-host", default=_env("advertise_host", ""))
    parser.add_argument("--heartbeat-ttl-s", type=float, default=float(_env("heartbeat_ttl_s", 5)))
    parser.add_argument("--drain-grace-s", type=float, default=float(_env("drain_grace_s", 30)),
                        help="on SIGTERM, how long to finish held requests before exiting")
    parser.add_argument("--standby", action="store_true",
                        default=_env("standby", "") not in ("", "0", "false"),
                        help="warm pool: load, profile and open ports, but join the registry "
                             "only when activated (splitserve standby --activate ID, or the autoscaler)")
    parser.add_argument("--tls-cert", default=_env("tls_cert", ""),
                        help="PEM certificate chain of this worker; with --tls-key and --tls-ca "
                             "the gRPC port speaks only mutual TLS")
    parser.add_argument("--tls-key", default=_env("tls_key", ""), help="PEM private key")
    parser.add_argument("--tls-ca", default=_env("tls_ca", ""),
                        help="PEM CA bundle; a peer whose certificate does not chain to it is "
                             "refused")
    parser.add_argument("--cluster-secret-file", default=_env("cluster_secret_file", ""),
                        help="file holding the cluster secret (>= 16 bytes) that signs registry "
                             "entries and authenticates KV channels")
    parser.add_argument("--kv-allowed-endpoints", default=_env("kv_allowed_endpoints", ""),
                        help="prefill: decode KV endpoints (host:port, host:* or *) accepted as "
                             "decode_kv_endpoint besides registered decode workers' (with "
                             "--redis-url) or this machine's (without)")
    parser.add_argument("--max-kv-senders", type=int, default=int(_env("max_kv_senders", 128)),
                        help="prefill: KV channels to decode endpoints open at once; a Prefill "
                             "call needing one more is refused with RESOURCE_EXHAUSTED")
    parser.add_argument("--max-queued-kv-transfers", type=int,
                        default=int(_env("max_queued_kv_transfers", 64)),
                        help="prefill: KV transfers queued per decode endpoint; a prompt's KV "
                             "waits for room (up to 10 s, then RESOURCE_EXHAUSTED)")
    parser.add_argument("--kv-shared-memory-mib", type=int,
                        default=int(_env("kv_shared_memory_mib", 64)),
                        help="KV between a prefill and a decode worker on one host goes through "
                             "a shared-memory region of this many MiB per channel (in /dev/shm) "
                             "instead of gloo over loopback; 0: gloo only")
    parser.add_argument("--log-level", default=_env("log_level", "INFO"))
    parser.add_argument("--log-format", choices=("json", "text"), default=_env("log_format", "json"))


def worker_config_from_args(args: argparse.Namespace, role: str | None) -> WorkerConfig:
    """Raises SystemExit with a one-line message for invalid settings (no traceback)."""
    try:
        return _build(args, role)
    except ValueError as exc:
        raise SystemExit(f"splitserve worker: {exc}") from None


def _build(args: argparse.Namespace, role: str | None) -> WorkerConfig:
    return WorkerConfig(
        role=role or args.role,
        model=args.model,
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        kv_port=args.kv_port,
        worker_id=args.worker_id,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_kv_blocks=args.num_kv_blocks,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        itl_target_ms=args.itl_target_ms,
        enable_prefix_caching=not args.no_prefix_caching,
        num_threads=args.num_threads,
        small_step_threads=args.small_step_threads,
        tensor_parallel_size=args.tensor_parallel_size,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        cuda_graph_max_batch=args.cuda_graph_max_batch,
        cuda_graph_max_context=args.cuda_graph_max_context,
        cpu_small_m_max_rows=args.cpu_small_m_max_rows,
        cpu_weight_layout=args.cpu_weight_layout,
        cpu_shared_prefix_attention=args.cpu_shared_prefix_attention == "on",
        cpu_kv_prefault_tokens=args.cpu_kv_prefault_tokens,
        structured_outputs_warmup=args.structured_outputs_warmup == "on",
        kv_wait_timeout_s=args.kv_wait_timeout_s,
        kv_transfer_timeout_s=args.kv_transfer_timeout_s,
        kv_reservation_ttl_s=args.kv_reservation_ttl_s,
        max_unread_outputs=args.max_unread_outputs,
        step_timeout_s=args.step_timeout_s,
        core_share=args.core_share,
        core_share_yield=args.core_share_yield,
        core_share_yield_burst_s=args.core_share_yield_burst_s,
        speculative_method=args.speculative_method,
        num_speculative_tokens=args.num_speculative_tokens,
        draft_model=args.draft_model,
        speculative_max_batch_size=args.speculative_max_batch_size,
        metrics_port=args.metrics_port,
        vllm_metrics=args.vllm_metrics,
        openai_port=args.openai_port,
        log_level=args.log_level,
        log_format=args.log_format,
        redis_url=args.redis_url,
        advertise_host=args.advertise_host,
        heartbeat_ttl_s=args.heartbeat_ttl_s,
        drain_grace_s=args.drain_grace_s,
        standby=args.standby,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_ca=args.tls_ca,
        cluster_secret_file=args.cluster_secret_file,
        kv_allowed_endpoints=args.kv_allowed_endpoints,
        max_kv_senders=args.max_kv_senders,
        max_queued_kv_transfers=args.max_queued_kv_transfers,
        kv_shared_memory_mib=args.kv_shared_memory_mib,
    )
