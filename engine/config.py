"""Typed configuration of an engine: the model's shape (from config.json) and the cache."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.scheduler import SchedulerConfig
from engine.spec_decode.config import SpeculativeConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively; elsewhere bf16 matmuls are emulated and
    slower than float32."""
    cpu = torch.cpu
    return cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported()


@dataclass(frozen=True)
class ModelConfig:
    """The part of a Hugging Face config.json the Llama family needs."""

    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    # Keys each layer's queries see, themselves included (0: all before them): Mistral's
    # `sliding_window` on every layer; Qwen2's when `use_sliding_window`, on the layers its
    # `layer_types` (or `max_window_layers`) names, as transformers reads them.
    layer_windows: tuple[int, ...] = ()

    def window_of(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in model directory {path}")
        raw = json.loads(config_file.read_text())
        architectures = raw.get("architectures") or ["?"]
        heads = raw["num_attention_heads"]
        rope = raw.get("rope_parameters") or {}
        rope_theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        rope_scaling = raw.get("rope_scaling")
        if rope.get("rope_type", "default") != "default":
            rope_scaling = rope
        eos = raw.get("eos_token_id")
        gen_file = path / "generation_config.json"
        if gen_file.is_file():
            eos = json.loads(gen_file.read_text()).get("eos_token_id", eos)
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        _check_rope_scaling(rope_scaling)
        return cls(
            path=str(path),
            architecture=architectures[0],
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=_qkv_bias(raw, architectures[0]),
            eos_token_ids=eos_ids,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype") or "float32",
            layer_windows=_layer_windows(raw, architectures[0], raw["num_hidden_layers"]),
        )


def _check_rope_scaling(scaling: dict | None) -> None:
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind not in (None, "default", "llama3"):
        raise ValueError(f"config.json: rope_scaling type {kind!r} is not supported "
                         "(supported: default, llama3)")


def _qkv_bias(raw: dict, architecture: str) -> bool:
    """Whether q/k/v have biases, as transformers builds each: Qwen2 always, Mistral never;
    Llama's attention_bias would put one on o_proj too, and mlp_bias on the MLP, which the
    fused C++ decode does not add: refused rather than half loaded."""
    if architecture == "Qwen2ForCausalLM":
        return True
    if architecture == "MistralForCausalLM":
        return False
    for name in ("attention_bias", "mlp_bias"):
        if raw.get(name):
            raise ValueError(f"config.json: {name}=true is not supported for {architecture} "
                             "(biases are supported on Qwen2's q/k/v projections only)")
    return False


def _layer_windows(raw: dict, architecture: str, num_layers: int) -> tuple[int, ...]:
    """Per-layer sliding windows, read as transformers reads them: Llama has none, Mistral
    slides every layer when `sliding_window` is set, Qwen2 only with `use_sliding_window`, on
    its `sliding_attention` layers (by default those from `max_window_layers` on)."""
    window = raw.get("sliding_window")
    if architecture == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
        window = None
    if architecture not in ("MistralForCausalLM", "Qwen2ForCausalLM") or window is None:
        return ()
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"config.json: sliding_window must be a positive integer, got {window!r}")
    if architecture == "MistralForCausalLM":
        return (window,) * num_layers
    kinds = raw.get("layer_types")
    if kinds is None:
        first = raw.get("max_window_layers", 28)
        kinds = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if len(kinds) != num_layers or not set(kinds) <= {"sliding_attention", "full_attention"}:
        raise ValueError(
            "config.json: layer_types must name one of full_attention / sliding_attention "
            f"per layer ({num_layers}), got {kinds!r}"
        )
    windows = tuple(window if kind == "sliding_attention" else 0 for kind in kinds)
    return windows if any(windows) else ()


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine needs; built from CLI flags / SPLITSERVE_* env by the services."""

    model: str
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    block_size: int = 16
    # Bytes of KV cache; 0: sized from memory after a profile step (engine/memory_profile.py):
    # on GPU from gpu_memory_utilization, on CPU from MemAvailable (at most 1 GiB).
    kv_cache_memory: int = 1 << 30
    gpu_memory_utilization: float = 0.9  # of the device's total, for everything this worker holds
    num_kv_blocks: int | None = None  # overrides the memory budget, and no profile step runs
    # CPU: while the engine is idle, fault in the KV pool's pages this many tokens' worth of
    # blocks ahead of the highest block handed out (engine/kv_prefault.py), so that steps do not
    # pay for first touches; -1: 4x max_num_batched_tokens; 0: off (pages fault as steps write).
    cpu_kv_prefault_tokens: int = -1
    # While the engine is first idle, build what the first request under a structured output
    # would wait for (the grammar tokenizer: about 0.3 s and 54 MiB on SmolLM2); False: on
    # that first request.
    structured_outputs_warmup: bool = True
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)  # off by default
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads on CPU (per rank)
    # Threads for CPU steps of at most 16 tokens (decode at small batches; engine/step_threads.py):
    # None: half of num_threads (one on 2 cores); equal to num_threads: every step uses all.
    # One rank only; needs num_threads set.
    small_step_threads: int | None = None
    # CPU attention: "cpp" runs the C++ kernels (kernels/cpu, built on first use): decode reads
    # K/V in place from the paged cache, and in bfloat16 on a CPU with AVX-512 BF16 prefill is
    # a flash kernel (on AMX tiles where the CPU has them, else bf16 dot products), kept where
    # it beats SDPA at start; "torch" is the reference (SDPA); "auto": cpp if it builds.
    cpu_attention: str = "auto"
    # CPU linear layers in bfloat16 with few rows (decode): "cpp" reads each weight row once for
    # all rows with AVX-512 BF16 dot products (kernels/linear.py), "torch" is torch's mm;
    # "auto": cpp where the CPU has avx512_bf16 and the kernels build.
    cpu_linear: str = "auto"
    # Most rows of x that take that kernel (0-64); -1: measured at start against torch's mm on
    # the model's weights (kernels/linear.py calibrate_small_m_max_rows), or 64 with cpu_linear
    # "cpp". Past a handful of rows torch's mm (oneDNN, AMX where present) can be faster.
    cpu_small_m_max_rows: int = -1
    # CPU linear weights in bfloat16: a copy of each packed once in the layout the tiles that
    # multiply it read (kernels/packed_weights.py), read by every matmul past the small-M
    # kernel's rows, so no call reorders a weight; it costs a second copy of the weights.
    # "amx": our AMX kernel's layout (a CPU with AMX BF16); "packed": oneDNN's blocked layout for
    # torch's matmul; "plain": torch's F.linear on the weights as loaded. "auto": amx where it
    # runs, else packed if it wins by 10% at 16 and 64 rows here, measured at start; either
    # only if the copies take at most a quarter of the host's available memory.
    cpu_weight_layout: str = "auto"
    # CPU steps of decode rows only, in bfloat16 with the C++ attention: "cpp" runs all decoder
    # layers in one C++ call (kernels/cpu/fused_decode.cpp, no Python per element-wise op),
    # "torch" runs the modules; "auto": cpp wherever it applies (one rank, Llama family).
    cpu_fused_decode: str = "auto"
    # CPU decode attention with the C++ kernel: decode rows whose block tables begin with the
    # same blocks (a shared system prompt, a document asked about) attend that prefix once for
    # all of their query heads, as a small matrix product (kernels/cpu/shared_prefix_decode.h;
    # kernels/attention.py find_shared_prefixes); False: every row reads its own context.
    cpu_shared_prefix_attention: bool = True
    # A file that workers sharing this host's cores lock in turn while they time kernels at
    # start (engine/kernel_choice.py measuring_alone); "": no lock. `splitserve up` sets it
    # for its co-located workers (the core share's file + ".measure").
    start_measurement_lock: str = ""
    # Attention kernels (kernels/attention.py uses_triton): "triton" runs kernels/triton, reading
    # the paged cache in place; "torch" the reference; "auto": triton on CUDA when it imports.
    attention_backend: str = "auto"
    # CUDA graphs for decode steps (engine/cuda_graphs.py; CUDA, Triton attention, one rank):
    # enforce_eager turns them off; a graph per batch size up to cuda_graph_max_batch (0: the
    # scheduler's max_num_seqs), for contexts up to cuda_graph_max_context (0: 8192 tokens,
    # at most max_model_len); other steps run eagerly.
    enforce_eager: bool = False
    cuda_graph_max_batch: int = 0
    cuda_graph_max_context: int = 0
    # Ranks (one process each) the model is split across, Megatron style; see engine/executor.py.
    tensor_parallel_size: int = 1

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but no CUDA device is available")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"unknown device {self.device!r} (choose auto, cpu or cuda)")
        return torch.device(self.device)

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            # The fast path is the default: bfloat16 on GPUs and on CPUs that multiply it
            # natively (AVX512_BF16 or AMX; README "Performance"), float32 on CPUs where bf16
            # would be emulated and slower. In bfloat16 a request's greedy tokens can depend on
            # which requests share its batch; tests that compare tokens across deployments, and
            # parity with the float32 reference, ask for --dtype float32 explicitly.
            if device.type == "cuda" or cpu_has_fast_bf16():
                return torch.bfloat16
            return torch.float32
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r} (choose auto, {', '.join(DTYPES)})")
        return DTYPES[self.dtype]
