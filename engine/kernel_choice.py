"""Which kernels a ModelRunner runs on its device: the config's choices (auto | torch | cpp),
checked against what this device, dtype, model and build allow, with a clear error for a
choice that cannot run; and where both a C++ kernel and torch's would do, which one is faster
on this host, measured at start (the prefill attention; the linear weights' layout; the
small-M linear's row count).

Every tensor-parallel rank calls these in the same order: the measurements agree across ranks
through a collective (min_over_ranks)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from engine.config import EngineConfig, ModelConfig
from engine.distributed import get_tp
from engine.layers.linear import amx_layout_fits, packable_bytes
from engine.memory_readers import HostMemory
from kernels import cpu_kernels
from kernels.attention import calibrate_prefill_attention
from kernels.linear import (
    SMALL_M_MAX_ROWS,
    calibrate_small_m_max_rows,
    calibration_layers,
    calibration_weights,
    small_m_linear_available,
)
from kernels.packed_weights import (
    AMX_K_MULTIPLE,
    LAYOUTS,
    PACKED_MEMORY_SHARE,
    amx_available,
    calibrate_packing,
    packing_available,
)

log = logging.getLogger("engine.model_runner")  # the runner's log: its kernel line is there too


@contextlib.contextmanager
def measuring_alone(lock_path: str) -> Iterator[None]:
    """Holds an exclusive lock on `lock_path` (created if missing; '': none) while this worker
    times kernels, so that workers sharing a host's cores take turns. Measured side by side
    on 2 cores, each timed the other's load: a decode worker once kept 0 small-M rows where
    the kernel wins at 4-32 (kernels/linear.py calibrate_small_m_max_rows), and two identical
    deployments started with 32 and 64."""
    if not lock_path:
        yield
        return
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # and with it the lock


def _check(name: str, choice: str) -> None:
    if choice not in ("auto", "torch", "cpp"):
        raise ValueError(f"unknown {name} {choice!r} (choose auto, torch or cpp)")


def native_decode(config: EngineConfig, device: torch.device) -> bool:
    """The C++ paged decode attention (cpu_attention)."""
    choice = config.cpu_attention
    _check("cpu_attention", choice)
    if device.type != "cpu" or choice == "torch":
        return False
    if cpu_kernels.load():
        return True
    if choice == "cpp":
        raise ValueError("cpu_attention 'cpp' was asked for but the C++ kernels did not build")
    return False


def native_prefill(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype,
                   decode: bool) -> bool:
    """The C++ prefill attention: where it applies (with the C++ decode attention, bf16, a
    head_dim it takes, AVX-512 BF16), and only if it beats torch's SDPA on this host, measured
    now on the model's head shape in chunks of the step's (at most 512 tokens, so the
    measurement stays short), unless cpu_attention "cpp" asks for it."""
    applies = (decode and dtype == torch.bfloat16 and model_config.head_dim % 16 == 0
               and model_config.head_dim <= 256 and small_m_linear_available())
    if not applies or config.cpu_attention == "cpp":
        return applies
    tp = get_tp()
    with measuring_alone(config.start_measurement_lock):
        calibration = calibrate_prefill_attention(
            model_config.num_heads // tp.size, max(model_config.num_kv_heads // tp.size, 1),
            model_config.head_dim, min(config.scheduler.long_prefill_token_threshold, 512))
    log.info("%s", calibration.describe())
    return tp.min_over_ranks(int(calibration.native)) == 1


def small_m_linear(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> bool:
    """The C++ small-M linear for few rows in bf16 (cpu_linear)."""
    choice = config.cpu_linear
    _check("cpu_linear", choice)
    if device.type != "cpu" or choice == "torch":
        return False
    if dtype == torch.bfloat16 and small_m_linear_available():
        return True
    if choice == "cpp":
        raise ValueError("cpu_linear 'cpp' needs --dtype bfloat16, a CPU with avx512_bf16 "
                         "and the C++ kernels built")
    return False


def weight_layout(config: EngineConfig, device: torch.device, dtype: torch.dtype,
                  model: torch.nn.Module) -> str:
    """The layout of the linear layers' packed weight copies (cpu_weight_layout): "amx" (our
    AMX kernel's tiles), "packed" (oneDNN's blocked layout) or "plain" (no copies: F.linear
    on the weights as loaded). Packing applies on the CPU in bf16; "auto" takes "amx" where
    the CPU has AMX BF16 and every weight suits it (it beat oneDNN's packed matmul at a decode
    batch's row counts, 1.1-1.7x: bench/cpu_linear.py --layouts), else measures now on the model's
    weights whether oneDNN's packing wins (kernels/packed_weights.py); either only if the
    copies take at most PACKED_MEMORY_SHARE of the memory available to it (available_memory)."""
    choice = config.cpu_weight_layout
    if choice not in ("auto", *LAYOUTS):
        raise ValueError(f"unknown cpu_weight_layout {choice!r} (choose auto, amx, packed or plain)")
    cpu_bf16 = device.type == "cpu" and dtype == torch.bfloat16
    if choice == "packed" and not (cpu_bf16 and packing_available()):
        raise ValueError("cpu_weight_layout 'packed' needs the CPU, --dtype bfloat16 and a torch "
                         "built with mkldnn (oneDNN)")
    amx = cpu_bf16 and amx_available() and amx_layout_fits(model)
    if choice == "amx" and not amx:
        raise ValueError("cpu_weight_layout 'amx' needs the CPU, --dtype bfloat16, a CPU with AMX "
                         "BF16, the C++ kernels built and every linear layer's in_features a "
                         f"multiple of {AMX_K_MULTIPLE}")
    if not cpu_bf16 or choice == "plain":
        return "plain"
    if choice != "auto":
        return choice
    layout = "plain"
    if amx:
        layout = "amx"
    elif packing_available():
        with measuring_alone(config.start_measurement_lock):
            calibration = calibrate_packing(calibration_weights(model))
        log.info("%s", calibration.describe())
        layout = "packed" if calibration.packed else "plain"
    needed, available = packable_bytes(model), available_memory()
    if layout != "plain" and needed > PACKED_MEMORY_SHARE * available:
        log.warning("linear weights stay plain: %s copies would take %.0f MiB of the %.0f MiB "
                    "available (at most %.0f%% allowed; --cpu-weight-layout %s forces them)",
                    layout, needed / 2**20, available / 2**20, PACKED_MEMORY_SHARE * 100, layout)
        layout = "plain"
    # Every rank multiplies its shard the same way: the least any rank could take.
    rank = get_tp().min_over_ranks(LAYOUTS[::-1].index(layout))
    return LAYOUTS[::-1][rank]


def available_memory(cgroup: str = "/sys/fs/cgroup") -> int:
    """Bytes this process may still take: the host's MemAvailable, or less where a container's
    memory limit (cgroup v2 memory.max over memory.current) leaves less."""
    available, _ = HostMemory().free_and_total()
    try:
        limit = Path(cgroup, "memory.max").read_text().strip()
        used = int(Path(cgroup, "memory.current").read_text().strip())
    except (OSError, ValueError):
        return available
    if limit == "max":
        return available
    return max(0, min(available, int(limit) - used))


def small_m_max_rows(config: EngineConfig, model: torch.nn.Module, packed: bool) -> int:
    """Rows up to which the linear layers take the C++ small-M kernel: cpu_small_m_max_rows
    when set (>= 0), every row count up to SMALL_M_MAX_ROWS with cpu_linear "cpp", else
    measured now on this model's weights against the path larger batches take (the layers'
    `packed` weights, use_packed_weights having run, or plain F.linear; kernels/linear.py)."""
    fixed = config.cpu_small_m_max_rows
    if fixed >= 0:
        return min(fixed, SMALL_M_MAX_ROWS)
    if config.cpu_linear == "cpp":
        return SMALL_M_MAX_ROWS
    layers = calibration_layers(model)
    with measuring_alone(config.start_measurement_lock):
        calibration = calibrate_small_m_max_rows(
            [layer.weight.detach() for layer in layers],
            packed=[layer.packed_weight for layer in layers] if packed else None)
    log.info("%s", calibration.describe())
    return get_tp().min_over_ranks(calibration.max_rows)


def fused_decode(config: EngineConfig, device: torch.device, dtype: torch.dtype, decode: bool,
                 model: torch.nn.Module) -> bool:
    """All decoder layers of a decode-only step in one C++ call (cpu_fused_decode)."""
    choice = config.cpu_fused_decode
    _check("cpu_fused_decode", choice)
    if choice == "torch":
        return False
    applies = (device.type == "cpu" and dtype == torch.bfloat16 and decode
               and get_tp().size == 1 and hasattr(model, "use_fused_decode"))
    if choice == "cpp" and not applies:
        raise ValueError("cpu_fused_decode 'cpp' needs the CPU, --dtype bfloat16, the C++ "
                         "attention (cpu_attention auto or cpp), one tensor-parallel rank "
                         "and a Llama-family model")
    return applies
