"""The C++ CPU kernels (kernels/cpu/*.cpp): compiled by `make install` (`python -m
kernels.cpu_kernels`), else on first use, with the machine's C++ compiler; cached by
torch.utils.cpp_extension and registered as torch.ops.splitserve_cpu.*.

Each has its torch reference in this package; tests/engine/test_cpu_kernels.py holds them to it.
Where no compiler is available, `load()` returns False and the references run instead. A build
is named by a digest of its sources and flags: a library already built for them is loaded as is.
"""

from __future__ import annotations

import hashlib
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
    "prefill_attention.cpp", "prefill_attention_amx.cpp", "greedy_argmax.cpp", "amx_linear.cpp",
    "sample_draw.cpp")]
_HEADERS = [Path(__file__).parent / "cpu" / name for name in (
    "vector_math.h", "prefill_attention_amx.h", "amx_linear.h", "decode_attention_parts.h",
    "per_row_decode.h", "shared_prefix_decode.h", "elementwise_avx512.h", "kv_pack_avx512.h")]
# A build lock older than this was left by a process killed mid-build (torch's own lock has no
# owner check, so every later load would wait on it forever); builds take about a minute.
STALE_LOCK_SECONDS = 15 * 60
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
_library: Path | None = None  # what load() loaded
_load_seconds = 0.0  # how long the one build-or-load took (worker start-up timing)


def load() -> bool:
    """Build (first time on this machine: about a minute) and load the kernels; True when
    torch.ops.splitserve_cpu is usable. Thread-safe; the outcome is remembered."""
    global _loaded, _load_seconds
    with _lock:
        if _loaded is None:
            start = time.monotonic()
            _loaded = _build()
            _load_seconds = time.monotonic() - start
        return _loaded


def loaded() -> bool:
    """Whether `load()` has loaded the kernels in this process (never builds or waits)."""
    return bool(_loaded)


def load_seconds() -> float:
    """Wall time of this process's build or load of the kernels (0 before `load()`)."""
    return _load_seconds


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
    # -fopenmp: at::parallel_for is inline, and without it compiles to a plain loop on one
    # thread. Linked, it shares the libgomp torch loaded (one pool, one torch.set_num_threads).
    # Measured: the small-M linear read 29 GB/s on one thread, 50 GB/s on two (gate_up_proj,
    # bench/cpu_linear.py).
    cflags = ["-O3", "-fno-math-errno", "-fopenmp", *_ISA_FLAGS.get(capability, [])]
    ldflags = ["-fopenmp"]
    name = build_name(capability, cflags, ldflags)
    try:
        build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
        library = build_dir / f"{name}.so"
        _remove_stale_lock(build_dir / "lock")
        if library.is_file() and not (build_dir / "lock").exists():
            # Built before for exactly these sources: no ninja run, no wait on the build lock.
            torch.ops.load_library(str(library))
            _set_library(library)
            log.info("C++ CPU kernels (%s) loaded from %s", capability, library)
            return True
        cpp_extension.load(
            name=name, sources=[str(s) for s in _SOURCES], extra_cflags=cflags,
            extra_ldflags=ldflags, build_directory=str(build_dir), is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, headers missing: fall back, loudly
        _error = f"{type(exc).__name__}: {exc}"
        log.warning("C++ CPU kernels unavailable, using the torch reference: %s", exc)
        return False
    _set_library(library)
    log.info("C++ CPU kernels (%s) ready in %.1fs", capability, time.monotonic() - start)
    return True


def library_path() -> Path | None:
    """The shared library `load()` loaded, None before or when it did not."""
    return _library


def _set_library(path: Path) -> None:
    global _library
    _library = path


def build_name(capability: str, cflags: list[str], ldflags: list[str]) -> str:
    """The build's name (and folder): the CPU capability and a digest of the sources, headers,
    flags and torch version, so checkouts or versions that differ never rebuild over each
    other and a finished build is never rebuilt."""
    digest = hashlib.sha256(repr((cflags, ldflags, torch.__version__)).encode())
    for path in (*_SOURCES, *_HEADERS):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return f"splitserve_cpu_kernels_{capability.lower()}_{digest.hexdigest()[:12]}"


def _remove_stale_lock(lock: Path) -> None:
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_SECONDS:
        log.warning("removing a build lock left %.0f min ago by a process that did not finish: %s",
                    age / 60, lock)
        lock.unlink(missing_ok=True)


def main() -> int:
    """`python -m kernels.cpu_kernels` (make install): build now, so no worker start waits on
    the compiler. Without a compiler it says so and succeeds: the torch references run."""
    start = time.monotonic()
    if load():
        print(f"C++ CPU kernels: {library_path()} ({time.monotonic() - start:.1f}s)")
    else:
        print(f"C++ CPU kernels not built; workers use the torch reference ({build_error()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
