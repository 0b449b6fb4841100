"""How vLLM's CPU build is started as the peer: its venv (bench/.peers/vllm, `make peers`), its
OpenAI server's command line and the environment of its best configuration on this machine.

vLLM's CPU worker binds its OpenMP threads to cores itself. Its default here binds one core and
reserves the other for the server process; on 2 cores it serves fastest with both cores bound
(VLLM_CPU_OMP_THREADS_BIND=0-1, none reserved) and Intel's OpenMP runtime (libiomp5, which the
venv carries) preloaded, so that is what the comparison runs, and prints.
"""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VLLM_VENV = REPO / "bench" / ".peers" / "vllm"
KVCACHE_SPACE_GIB = 4
MAX_MODEL_LEN = 4096


def libiomp(venv: Path) -> Path:
    """The venv's libiomp5.so (installed by the intel-openmp wheel into <venv>/lib)."""
    direct = venv / "lib" / "libiomp5.so"
    if direct.exists():
        return direct
    found = sorted(venv.glob("lib/**/libiomp5.so"))
    if not found:
        raise RuntimeError(f"no libiomp5.so under {venv}; is vLLM installed there (make peers)?")
    return found[0]


def max_model_len(model_dir: str) -> int:
    """MAX_MODEL_LEN, or less for a model with fewer positions (vLLM refuses more)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return MAX_MODEL_LEN
    return min(MAX_MODEL_LEN, int(config.get("max_position_embeddings") or MAX_MODEL_LEN))


def vllm_command(venv: Path, model_dir: str, port: int, dtype: str) -> list[str]:
    # The module, not the `vllm` console script: the CLI fails to start with this CPU build.
    return [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
            "--model", model_dir, "--dtype", dtype,
            "--max-model-len", str(max_model_len(model_dir)),
            "--host", "127.0.0.1", "--port", str(port)]


def vllm_env(venv: Path, threads: int) -> dict[str, str]:
    """`threads` OpenMP threads bound to cores 0..threads-1, no core reserved."""
    return {"VLLM_CPU_KVCACHE_SPACE": str(KVCACHE_SPACE_GIB),
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if threads > 1 else "0",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "LD_PRELOAD": str(libiomp(venv))}


def vllm_version(venv: Path = VLLM_VENV) -> str:
    """From the installed distribution's metadata (importing vllm takes seconds)."""
    for dist in sorted(venv.glob("lib/python*/site-packages/vllm*.dist-info")):
        name, _, version = dist.name.removesuffix(".dist-info").partition("-")
        if name in ("vllm", "vllm_cpu"):
            return version
    return "absent"


def vllm_settings_note(dtype: str, threads: int) -> str:
    bind = f"0-{threads - 1}" if threads > 1 else "0"
    return (f"vLLM {vllm_version()} (CPU build, bench/.peers/vllm): --dtype {dtype}, "
            f"--max-model-len {MAX_MODEL_LEN} (fewer if the model has fewer positions), VLLM_CPU_KVCACHE_SPACE={KVCACHE_SPACE_GIB} GiB, "
            f"{threads} OpenMP threads bound to cores {bind} "
            f"(VLLM_CPU_OMP_THREADS_BIND={bind}, VLLM_CPU_NUM_OF_RESERVED_CPU=0; its default binds "
            "one core and reserves the other), libiomp5 preloaded (LD_PRELOAD), its own defaults "
            "otherwise (prefix caching and chunked prefill on); it has no admission control and "
            "queues everything")
