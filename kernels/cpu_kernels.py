"""The C++ CPU kernels (kernels/cpu/*.cpp): compiled on first use with the machine's C++
compiler, cached by torch.utils.cpp_extension, and registered as torch.ops.splitserve_cpu.*.

Each has its torch reference in this package; tests/engine/test_cpu_kernels.py holds them to it.
Where no compiler is available, `load()` returns False and the references run instead.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCES = [Path(__file__).parent / "cpu" / name for name in (
    "paged_decode_attention.cpp", "small_m_linear.cpp", "fused_decode.cpp",
    "prefill_attention.cpp")]
# Vector instructions per torch CPU capability. The capability is part of the build's name,
# so a cache shared between machines never hands one CPU code built for another. (The AVX-512
# BF16 code in small_m_linear.cpp is compiled for its own functions only and chosen at run time.)
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}

_lock = threading.Lock()
_loaded: bool | None = None
_error: str | None = None  # why the build failed, when it did


def load() -> bool:
    """Build (first time on this machine: about a minute) and load the kernels; True when
    torch.ops.splitserve_cpu is usable. Thread-safe; the outcome is remembered."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _build()
        return _loaded


def build_error() -> str | None:
    """Why `load()` returned False (the compiler's or loader's message); None if it did not."""
    return _error


def _build() -> bool:
    global _error
    from torch.utils import cpp_extension

    capability = torch.backends.cpu.get_cpu_capability()
    # The ninja that pip installed sits beside this interpreter, which may not be on PATH.
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    start = time.monotonic()
    try:
        cpp_extension.load(
            name=f"splitserve_cpu_kernels_{capability.lower()}",
            sources=[str(s) for s in _SOURCES],
            # -fopenmp: at::parallel_for is inline, and without it compiles to a plain loop on
            # one thread. Linked, it shares the libgomp torch loaded (one pool, one
            # torch.set_num_threads). Measured: the small-M linear read 29 GB/s on one thread,
            # 50 GB/s on two (gate_up_proj, bench/cpu_linear.py).
            extra_cflags=["-O3", "-fno-math-errno", "-fopenmp", *_ISA_FLAGS.get(capability, [])],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, headers missing: fall back, loudly
        _error = f"{type(exc).__name__}: {exc}"
        log.warning("C++ CPU kernels unavailable, using the torch reference: %s", exc)
        return False
    log.info("C++ CPU kernels (%s) ready in %.1fs", capability, time.monotonic() - start)
    return True
