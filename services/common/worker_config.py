"""One typed configuration object per worker process, from CLI flags and SPLITSERVE_* env."""

from __future__ import annotations

import os
import re
import socket
from dataclasses import asdict, dataclass

from engine.config import EngineConfig, ModelConfig
from engine.distributed import check_tensor_parallel_size
from engine.scheduler import SchedulerConfig
from engine.spec_decode.config import METHODS as SPECULATIVE_METHODS
from engine.spec_decode.config import SpeculativeConfig
from kernels.attention import ATTENTION_BACKENDS
from kv_transfer.shared_memory import region_bytes_ok
from services.common.addresses import check_port
from services.common.core_share import DEFAULT_YIELD_BURST_S, DEFAULT_YIELD_SHARE
from services.common.engine_loop import DEFAULT_KV_RESERVATION_TTL_S, DEFAULT_MAX_UNREAD_OUTPUTS
from services.common.security import TLSFiles, read_cluster_secret
from services.prefill.kv_endpoints import parse_allow_list

ROLES = ("prefill", "decode", "both")
# Step-time target of steps that carry decoding requests (--itl-target-ms), by role: a decode
# worker prefills only by exception (conditional disaggregation, recompute), and its streams
# are what disaggregation protects; an aggregated worker keeps whole chunks by default
# (throughput and TTFT first, as vLLM does). -1 on the command line: the role's.
ITL_TARGET_MS = {"decode": 150.0, "both": 0.0, "prefill": 0.0}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
          "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def parse_size(text: str) -> int:
    """'2GiB' -> 2147483648; '512M' -> 512000000; plain numbers are bytes."""
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"cannot read {text!r} as a size (examples: 512MiB, 2GiB, 1000000)")
    unit = (match.group(2) or "").upper().removesuffix("B")
    return int(float(match.group(1)) * _UNITS[unit])


def kv_cache_bytes(text: str) -> int:
    """--kv-cache-memory in bytes; 0 for "auto" (the engine sizes the pool from memory)."""
    if str(text).strip().lower() == "auto":
        return 0
    size = parse_size(text)
    if size <= 0:
        raise ValueError(f"--kv-cache-memory {text!r} is no memory; give a size or auto")
    return size


@dataclass(frozen=True)
class WorkerConfig:
    role: str
    model: str
    served_model_name: str = ""  # clients' name for it (empty: the model folder's name)
    host: str = "127.0.0.1"
    port: int = 50051
    # kv_transfer endpoint of a decode worker (its TCPStore); 0 picks a free port.
    kv_port: int = 0
    worker_id: str = ""
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    # "auto": sized at start from a profile step (engine/memory_profile.py); else a size.
    kv_cache_memory: str = "auto"
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int = 0
    max_model_len: int = 0
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    long_prefill_token_threshold: int = 512
    # Steps that carry decoding requests take only the prompt tokens measured to fit this
    # step time (engine/step_budget.py); 0: off.
    itl_target_ms: float = -1.0  # -1: the role's default (ITL_TARGET_MS)
    enable_prefix_caching: bool = True
    num_threads: int = 0
    # Threads for steps of at most 16 tokens (engine/step_threads.py); 0: half of num_threads.
    small_step_threads: int = 0
    # Processes (ranks) the model is split across; each owns the KV cache of its heads.
    tensor_parallel_size: int = 1
    # auto | torch | triton (kernels/attention.py): auto runs the Triton kernels on CUDA.
    attention_backend: str = "auto"
    # CUDA graphs for decode steps (engine/cuda_graphs.py): off with enforce_eager; 0: defaults.
    enforce_eager: bool = False
    cuda_graph_max_batch: int = 0
    cuda_graph_max_context: int = 0
    # CPU bf16: most rows the C++ small-M linear takes; -1: measured at start (engine/config.py).
    cpu_small_m_max_rows: int = -1
    # CPU bf16: linear weights also packed for AMX or oneDNN (auto | amx | packed | plain;
    # engine/config.py).
    cpu_weight_layout: str = "auto"
    # CPU C++ decode attention: a prefix several rows share attended once (engine/config.py).
    cpu_shared_prefix_attention: bool = True
    # CPU: fault in the KV pool's pages this many tokens ahead of use while idle; -1: 4x
    # max_num_batched_tokens; 0: off (engine/kv_prefault.py).
    cpu_kv_prefault_tokens: int = -1
    # Build the grammar tokenizer and the masks' threads while first idle (54 MiB), not on the
    # first request under a structured output (about 0.5 s of its first token).
    structured_outputs_warmup: bool = True
    # Decode role: how long a reserved request waits for its KV before recomputing locally.
    kv_wait_timeout_s: float = 60.0
    kv_transfer_timeout_s: float = 30.0
    # Decode role: the engine loop's own bound on a reservation whose KV never came, whoever
    # forgot it (recomputed if its stream is open, freed if not).
    kv_reservation_ttl_s: float = DEFAULT_KV_RESERVATION_TTL_S
    # Outputs a request may have waiting for its reader; past it the request is aborted.
    max_unread_outputs: int = DEFAULT_MAX_UNREAD_OUTPUTS
    # One engine step longer than this makes the worker not ready until it ends; 0: off.
    step_timeout_s: float = 60.0
    # Workers of one host that split its cores lend them while idle (a file every one maps,
    # services/common/core_share.py); "": off. CPU, one process per worker, --num-threads set.
    core_share: str = ""
    # Of a worker that does not prefill: at most this share of its time pauses while a
    # co-located prefill worker steps, so prompts run on every core; 0: never pauses.
    core_share_yield: float = DEFAULT_YIELD_SHARE
    # ... and at most this long at once (the credit's cap).
    core_share_yield_burst_s: float = DEFAULT_YIELD_BURST_S
    # Decode role: speculative decoding, "" (off), "ngram" or "draft" (see engine/spec_decode).
    speculative_method: str = ""
    num_speculative_tokens: int = 4
    draft_model: str = ""
    speculative_max_batch_size: int = 0  # 0: measured throughput decides per batch size
    # HTTP /metrics, /health, /ready; 0 picks a free port, -1 disables.
    metrics_port: int = 0
    # The metrics again under vLLM's names (services/common/vllm_metrics.py).
    vllm_metrics: bool = True
    # OpenAI-compatible HTTP on this port (services/common/openai_endpoint.py); 0: off.
    openai_port: int = 0
    log_level: str = "INFO"
    log_format: str = "json"  # json | text
    # With a Redis URL the worker registers itself (heartbeat) and publishes prefix events.
    redis_url: str = ""
    # Address peers dial to reach this worker (defaults to --host; set it when binding 0.0.0.0).
    advertise_host: str = ""
    heartbeat_ttl_s: float = 5.0
    drain_grace_s: float = 30.0
    # Warm pool (services/common/standby.py): start fully but join the registry only when
    # activated through Redis.
    standby: bool = False
    # Mutual TLS on the gRPC port (services/common/security.py): all three PEM files or none.
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    # The shared secret (a file) that signs this worker's registry entries and KV channels.
    cluster_secret_file: str = ""
    # Prefill role: decode KV endpoints accepted besides registered decode workers' (with
    # --redis-url) or this machine's (without); comma-separated host:port, host:* or *.
    kv_allowed_endpoints: str = ""
    # Prefill role: KV channels (decode endpoints) open at once; a new one past it is refused.
    max_kv_senders: int = 128
    # Prefill role: KV transfers queued per decode endpoint; a prompt's KV waits for room.
    max_queued_kv_transfers: int = 64
    # KV between a prefill and a decode worker on one host crosses a shared-memory region of
    # this size per channel instead of gloo's TCP pair; 0 keeps every payload on gloo.
    kv_shared_memory_mib: int = 64

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r} (choose {', '.join(ROLES)})")
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"--model {self.model!r} is not a model folder (no config.json)")
        kv_cache_bytes(self.kv_cache_memory)
        # Each was a traceback from deep in the engine's build (ZeroDivisionError, a negative
        # mmap length) or, for --max-num-seqs 0, a worker that said it was ready and could run
        # nothing (a CLI audit).
        for flag, value, least, meaning in (
                ("--block-size", self.block_size, 1, ""),
                ("--num-kv-blocks", self.num_kv_blocks, 0, " (0: sized from memory)"),
                ("--max-model-len", self.max_model_len, 0, " (0: the model's)"),
                ("--max-num-batched-tokens", self.max_num_batched_tokens, 1, ""),
                ("--max-num-seqs", self.max_num_seqs, 1, ""),
                ("--long-prefill-token-threshold", self.long_prefill_token_threshold, 0, "")):
            if value < least:
                raise ValueError(f"{flag} must be >= {least}{meaning}, got {value}")
        check_port("--port", self.port)
        check_port("--kv-port", self.kv_port)
        check_port("--metrics-port", self.metrics_port, off=True)
        if self.num_threads < 0:
            raise ValueError("--num-threads must be >= 0 (0: torch's own count)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("--gpu-memory-utilization must be in (0, 1]")
        if self.kv_wait_timeout_s <= 0:
            raise ValueError("--kv-wait-timeout-s must be > 0")
        if self.kv_reservation_ttl_s <= 0:
            raise ValueError("--kv-reservation-ttl-s must be > 0")
        if self.max_unread_outputs < 1:
            raise ValueError("--max-unread-outputs must be >= 1")
        if self.itl_target_ms < 0 and self.itl_target_ms != -1:
            raise ValueError("--itl-target-ms must be >= 0 (0 turns it off), or -1 (the "
                             "role's default)")
        if self.step_timeout_s < 0:
            raise ValueError("--step-timeout-s must be >= 0 (0 turns the step watchdog off)")
        if self.core_share and (self.num_threads < 1 or self.tensor_parallel_size != 1
                                or self.device not in ("auto", "cpu")):
            raise ValueError("--core-share lends CPU threads between workers of one host: it "
                             "needs --num-threads (this worker's own share), one process per "
                             "worker (--tensor-parallel-size 1) and the CPU")
        if not 0.0 <= self.core_share_yield <= 1.0:
            raise ValueError("--core-share-yield must be in [0, 1] (0: decode never pauses for "
                             "a co-located prefill worker's steps)")
        if not 0.0 <= self.core_share_yield_burst_s <= 60.0:
            raise ValueError("--core-share-yield-burst-s must be in [0, 60] seconds")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"--attention-backend {self.attention_backend!r} is not one of "
                             f"{', '.join(ATTENTION_BACKENDS)}")
        if self.cuda_graph_max_batch < 0 or self.cuda_graph_max_context < 0:
            raise ValueError("--cuda-graph-max-batch and --cuda-graph-max-context must be >= 0 "
                             "(0: the defaults)")
        if not -1 <= self.cpu_small_m_max_rows <= 64:
            raise ValueError("--cpu-small-m-max-rows must be -1 (measured at start) or 0 to 64")
        if self.cpu_kv_prefault_tokens < -1:
            raise ValueError("cpu_kv_prefault_tokens must be >= -1 (-1: 4x max_num_batched_tokens, "
                             "0: off)")
        if self.cpu_weight_layout not in ("auto", "amx", "packed", "plain"):
            raise ValueError("--cpu-weight-layout must be auto, amx, packed or plain")
        self._check_speculative()
        self.tls.check()
        if self.cluster_secret_file:
            read_cluster_secret(self.cluster_secret_file)
        parse_allow_list(self.kv_allowed_endpoints)
        if self.max_kv_senders < 1:
            raise ValueError("--max-kv-senders must be >= 1")
        if self.max_queued_kv_transfers < 1:
            raise ValueError("--max-queued-kv-transfers must be >= 1")
        if self.kv_shared_memory_mib and (reason := region_bytes_ok(self.kv_shared_memory_bytes)):
            raise ValueError(f"--kv-shared-memory-mib {self.kv_shared_memory_mib}: {reason} "
                             "(0 turns it off)")
        if self.standby and not self.redis_url:
            raise ValueError("--standby waits for an activation in Redis: it needs --redis-url")
        self._check_openai_port()
        if self.tensor_parallel_size != 1:
            model = ModelConfig.from_dir(self.model)
            check_tensor_parallel_size(self.tensor_parallel_size, model.num_heads,
                                       model.num_kv_heads, model.intermediate_size,
                                       self.model_name)

    def resolved_itl_target_ms(self) -> float:
        if self.itl_target_ms == -1:
            return ITL_TARGET_MS[self.role]
        return self.itl_target_ms

    def _check_openai_port(self) -> None:
        if not 0 <= self.openai_port <= 65535:
            raise ValueError("--openai-port must be a port, or 0 (off)")
        if self.openai_port and self.role != "both":
            raise ValueError("--openai-port serves whole requests: it needs --role both")
        if self.openai_port and self.openai_port in (self.port, self.metrics_port):
            raise ValueError("--openai-port must differ from --port and --metrics-port")

    def _check_speculative(self) -> None:
        method = self.speculative_method
        if method and method not in SPECULATIVE_METHODS:
            raise ValueError(f"--speculative-method {method!r} is not one of "
                             f"{', '.join(SPECULATIVE_METHODS)}")
        if method == "draft" and not self.draft_model:
            raise ValueError("--speculative-method draft needs --draft-model DIR")
        if self.draft_model and method != "draft":
            raise ValueError("--draft-model is used only with --speculative-method draft")
        if self.draft_model and not os.path.isfile(os.path.join(self.draft_model, "config.json")):
            raise ValueError(f"--draft-model {self.draft_model!r} is not a model folder "
                             "(no config.json)")
        if method == "draft" and self.tensor_parallel_size > 1:
            raise ValueError("--speculative-method draft does not run with "
                             "--tensor-parallel-size > 1 yet; use ngram")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("--num-speculative-tokens must be in [1, 16]")
        if self.speculative_max_batch_size < 0:
            raise ValueError("--speculative-max-batch-size must be >= 0")

    def speculative_config(self) -> SpeculativeConfig:
        """Off on a prefill-only worker: it never decodes past the first token."""
        if not self.speculative_method or self.role == "prefill":
            return SpeculativeConfig()
        return SpeculativeConfig(
            method=self.speculative_method,
            num_speculative_tokens=self.num_speculative_tokens,
            draft_model=self.draft_model or None,
            max_batch_size=self.speculative_max_batch_size,
        )

    @property
    def kv_shared_memory_bytes(self) -> int:
        return self.kv_shared_memory_mib << 20

    @property
    def tls(self) -> TLSFiles:
        return TLSFiles(self.tls_cert, self.tls_key, self.tls_ca)

    @property
    def public_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        if self.host == "0.0.0.0":
            return socket.gethostbyname(socket.gethostname())
        if self.host == "::":  # both families listen: this machine's IPv6 address, else IPv4
            try:
                return socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET6)[0][4][0]
            except OSError:
                return socket.gethostbyname(socket.gethostname())
        return self.host

    @property
    def model_name(self) -> str:
        """The model folder's name: this worker's identity in the registry and Health, by
        which the gateway pairs a prefill worker only with a decode worker of the same
        version (a model update keeps the served name and changes the folder)."""
        return os.path.basename(os.path.normpath(self.model))

    @property
    def served_name(self) -> str:
        """What clients call the model: the OpenAI port's name and the metrics' label."""
        return self.served_model_name or self.model_name

    @property
    def resolved_worker_id(self) -> str:
        return self.worker_id or f"{self.role}-{socket.gethostname()}-{self.port}"

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model,
            dtype=self.dtype,
            device=self.device,
            block_size=self.block_size,
            kv_cache_memory=kv_cache_bytes(self.kv_cache_memory),
            gpu_memory_utilization=self.gpu_memory_utilization,
            num_kv_blocks=self.num_kv_blocks or None,
            max_model_len=self.max_model_len or None,
            enable_prefix_caching=self.enable_prefix_caching,
            scheduler=SchedulerConfig(
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                itl_target_s=self.resolved_itl_target_ms() / 1e3,
            ),
            num_threads=self.num_threads or None,
            small_step_threads=self.small_step_threads or None,
            tensor_parallel_size=self.tensor_parallel_size,
            attention_backend=self.attention_backend,
            enforce_eager=self.enforce_eager,
            cuda_graph_max_batch=self.cuda_graph_max_batch,
            cuda_graph_max_context=self.cuda_graph_max_context,
            cpu_small_m_max_rows=self.cpu_small_m_max_rows,
            cpu_weight_layout=self.cpu_weight_layout,
            cpu_shared_prefix_attention=self.cpu_shared_prefix_attention,
            # Co-located workers time their kernels at start in turn.
            start_measurement_lock=self.core_share + ".measure" if self.core_share else "",
            cpu_kv_prefault_tokens=self.cpu_kv_prefault_tokens,
            structured_outputs_warmup=self.structured_outputs_warmup,
            speculative=self.speculative_config(),
        )

    def describe(self) -> str:
        return " ".join(f"{k}={v}" for k, v in asdict(self).items())
