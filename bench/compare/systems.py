"""The systems under comparison, each started as child processes on this machine and stopped in
teardown: splitserve disaggregated and aggregated (`splitserve up`) and `transformers serve
--continuous-batching`, the peer.

The sweep's main thread owns every process started here; one system runs at a time, so each has
the machine's cores to itself (the load generator shares them).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from splitserve_cli.processes import free_port

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class PeerOptions:
    """`transformers serve` settings. The issue author's reference numbers used bf16 and 4096
    blocks of 16; the default here keeps the checkpoint's dtype (float32 for the converted
    SmolLM2), the one splitserve serves, so both run the same arithmetic."""

    dtype: str = "auto"
    cb_num_blocks: int = 4096
    cb_block_size: int = 16
    cb_max_batch_tokens: int = 0  # 0: transformers' own default
    num_threads: int = 0  # OMP_NUM_THREADS for the server (0: torch's default, one per core)


@dataclass(frozen=True)
class SystemSpec:
    name: str
    label: str
    flavor: str  # how loadgen asks it for exact output lengths

    def command(self, model_dir: str, port: int, peer: PeerOptions) -> list[str]:
        if self.name.startswith("splitserve-"):
            mode = self.name.removeprefix("splitserve-")
            return [sys.executable, "-m", "splitserve_cli.main", "up", "--mode", mode,
                    "--port", str(port), "--model", model_dir]
        return [str(Path(sys.executable).with_name("transformers")), "serve",
                "--continuous-batching", "--device", "cpu", "--dtype", peer.dtype,
                "--cb-num-blocks", str(peer.cb_num_blocks),
                "--cb-block-size", str(peer.cb_block_size),
                *(["--cb-max-batch-tokens", str(peer.cb_max_batch_tokens)]
                  if peer.cb_max_batch_tokens else []),
                "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", model_dir]


SYSTEMS = {
    s.name: s for s in (
        SystemSpec("splitserve-disagg", "splitserve disaggregated", "openai"),
        SystemSpec("splitserve-agg", "splitserve aggregated", "openai"),
        SystemSpec("transformers-serve", "transformers serve (CB)", "transformers"),
    )
}


@dataclass
class RunningSystem:
    spec: SystemSpec
    url: str
    model_name: str
    process: subprocess.Popen
    log_path: Path
    command: list[str]  # as run, for the report (environment overrides first)

    def stop(self, timeout_s: float = 45.0) -> None:
        """SIGTERM (splitserve up then stops its gateway and workers itself), SIGKILL if it
        outlives the timeout."""
        if self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _wait_ready(spec: SystemSpec, process: subprocess.Popen, url: str, log_path: Path,
                deadline: float) -> None:
    probe = f"{url}/ready" if spec.name.startswith("splitserve-") else f"{url}/health"
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{spec.name} exited with code {process.returncode}:\n"
                               f"{_log_tail(log_path)}")
        try:
            if httpx.get(probe, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{spec.name} was not ready at {probe} in time:\n{_log_tail(log_path)}")


def start_system(spec: SystemSpec, model_dir: str, log_dir: Path, peer: PeerOptions = PeerOptions(),
                 startup_timeout_s: float = 300.0) -> RunningSystem:
    port = free_port()
    command = spec.command(model_dir, port, peer)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{spec.name}.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    shown = []  # environment overrides, for the report
    if peer.num_threads and not spec.name.startswith("splitserve-"):
        env["OMP_NUM_THREADS"] = str(peer.num_threads)
        shown.append(f"OMP_NUM_THREADS={peer.num_threads}")
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, cwd=REPO, env=env,
                                   start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    running = RunningSystem(spec, url, model_dir, process, log_path, shown + command)
    try:
        _wait_ready(spec, process, url, log_path, time.monotonic() + startup_timeout_s)
        if spec.name.startswith("splitserve-"):
            running.model_name = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        # transformers serve is pinned to the path it was given and wants exactly that name.
    except BaseException:
        running.stop()
        raise
    return running
