"""Shared fixtures: tiny random checkpoints, the prepared SmolLM2 folder, throwaway redis servers."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# Set before any test module imports torch: inductor would otherwise compile with a worker per core.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Without CUDA the Triton kernels (tests/kernels) run under Triton's interpreter, which must be
# on before anything imports triton (torch._dynamo does, and tests collected earlier may
# import it); tests/kernels/conftest.py says the same for a run of that folder alone. Neither
# nvidia-smi nor the driver's device node: no CUDA device to compile for (some GPU containers
# lack the binary; bench/gpu/check.sh also sets TRITON_INTERPRET=0, which this leaves).
if shutil.which("nvidia-smi") is None and not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Worker processes started by tests compute in float32: tokens compared across deployments
# (disaggregated against one engine, TP against one rank) must not depend on batching, which
# they can in bfloat16. Tests of the shipped defaults start theirs with `shipped_env()`.
DTYPE_ENV = "SPLITSERVE_DTYPE"
os.environ.setdefault(DTYPE_ENV, "float32")


def shipped_env() -> dict[str, str]:
    """This process's environment without the test-wide dtype: what a user's shell has."""
    return {k: v for k, v in os.environ.items() if k != DTYPE_ENV}


REPO_ROOT = Path(__file__).resolve().parent.parent
SMOLLM2_DIR = REPO_ROOT / "models" / "smollm2-135m-instruct"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip_gpu)


# --- model folders -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama checkpoint (GQA 8/4 heads), built once per session. Treat as read-only."""
    from splitserve_cli.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 checkpoint (qkv bias, tied embeddings), built once per session."""
    from splitserve_cli.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2", seed=0)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct folder written by `make model`; skips when it is absent."""
    from splitserve_cli.prepare_model import is_complete

    if not is_complete(SMOLLM2_DIR):
        pytest.skip(
            f"{SMOLLM2_DIR.relative_to(REPO_ROOT)} is missing or incomplete; run `make model`"
        )
    return SMOLLM2_DIR


# --- redis ---------------------------------------------------------------------------------------


@dataclass
class RedisServer:
    """A redis-server child process on 127.0.0.1; owned by the test that started it."""

    process: subprocess.Popen
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> None:
        # Only ever our own child, by its PID; never a name-based kill.
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def start_redis_server(workdir: Path, attempts: int = 3) -> RedisServer:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed; run `make redis`")
    for _ in range(attempts):
        port = _free_port()  # another process may grab it before redis binds: hence the retries
        process = subprocess.Popen(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(workdir),
                "--loglevel",
                "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        server = RedisServer(process, port)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and process.poll() is None:
            if _answers_ping(port):
                return server
            time.sleep(0.05)
        server.stop()
    raise RuntimeError(f"redis-server did not start after {attempts} attempts")


@pytest.fixture
def redis_server_factory(tmp_path: Path) -> Iterator[Callable[[], RedisServer]]:
    """Start any number of redis servers (e.g. to kill one mid-test); all are stopped at teardown."""
    servers: list[RedisServer] = []

    def start() -> RedisServer:
        server = start_redis_server(tmp_path)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def redis_server(redis_server_factory: Callable[[], RedisServer]) -> str:
    """URL of a fresh, empty redis-server on a free port, stopped after the test."""
    return redis_server_factory().url
