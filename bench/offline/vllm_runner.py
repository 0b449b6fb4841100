"""vLLM's offline `LLM.generate` as a peer: the plan goes to a child process on the peer venv's
python (bench/.peers/vllm, `make peers`) with the environment of vLLM's best CPU configuration
here (bench/compare/vllm_peer.py), and its timed runs come back as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.compare.vllm_peer import VLLM_VENV, max_model_len, vllm_env
from bench.offline.workload import Workload

CHILD = Path(__file__).resolve().parent / "vllm_child.py"
TIMEOUT_S = 1800


def available(venv: Path = VLLM_VENV) -> bool:
    return (venv / "bin" / "python").exists()


def child_env(threads: int, venv: Path = VLLM_VENV) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, **vllm_env(venv, threads), "TORCHINDUCTOR_COMPILE_THREADS": "1",
            "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def run_vllm(model: str, dtype: str, threads: int, seed: int, plan: dict[str, list[Workload]],
             phases, venv: Path = VLLM_VENV) -> dict:
    """The child's result: version, startup_s, settings (what vLLM resolved) and runs by phase."""
    if not available(venv):
        raise RuntimeError(f"no vLLM venv at {venv}: run `make peers` (or pass --skip-vllm)")
    with tempfile.TemporaryDirectory(prefix="vllm-offline-") as tmp:
        spec, result = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec.write_text(json.dumps({
            "model": model, "dtype": dtype, "threads": threads, "seed": seed,
            "max_model_len": max_model_len(model), "phases": list(phases),
            "plan": {phase: [w.to_json() for w in works] for phase, works in plan.items()}}))
        proc = subprocess.run([str(venv / "bin" / "python"), str(CHILD), str(spec), str(result)],
                              env=child_env(threads, venv), stdout=sys.stdout, stderr=sys.stderr,
                              timeout=TIMEOUT_S, check=False)
        if proc.returncode != 0 or not result.exists():
            raise RuntimeError(f"the vLLM child exited with {proc.returncode} (its output is above)")
        return json.loads(result.read_text())
