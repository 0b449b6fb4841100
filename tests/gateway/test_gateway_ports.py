"""A port another process holds is refused in one line naming its flag, before anything
starts: the gateway's --port, --admin-port and --grpc-port, and `splitserve up`'s before its
workers load. And no gRPC server here shares a port: grpc-core binds with SO_REUSEPORT unless
told not to, so a second gateway on a taken --grpc-port started, said it was ready, and the two
split the port's calls between them (a README audit)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest

from services.common.server import GRPC_OPTIONS
from services.gateway.api.grpc import server_options
from services.gateway.config import GatewayConfig

pytestmark = pytest.mark.timeout(120)


@contextmanager
def held_port(reuse_port: bool = True) -> Iterator[int]:
    """A port this process listens on, as a gRPC server holds one (SO_REUSEPORT)."""
    with socket.socket() as held:
        if reuse_port:
            held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "splitserve_cli.main", *args],
                          capture_output=True, text=True, timeout=90)


@pytest.mark.parametrize("flag", ["--port", "--admin-port", "--grpc-port"])
def test_a_gateway_port_another_process_holds_is_refused_in_one_line(tiny_llama_dir, flag):
    with held_port() as port:
        others = {"--port": "0", "--admin-port": "0", "--grpc-port": "-1", flag: str(port)}
        done = _cli("gateway", "--model", str(tiny_llama_dir), "--worker", "127.0.0.1:1",
                    *(part for item in others.items() for part in item))
    assert done.returncode == 1, done.stderr[-2000:]
    assert f"splitserve gateway: {flag} {port} on 127.0.0.1 cannot be bound" in done.stderr, \
        done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "SPLITSERVE_READY" not in done.stdout


def test_up_refuses_a_taken_port_before_its_workers_load(tiny_llama_dir):
    """It loaded both workers (~15 s) and then said "gateway exited with code 1"."""
    with held_port(reuse_port=False) as port:
        done = _cli("up", "--model", str(tiny_llama_dir), "--port", str(port))
    assert done.returncode == 1
    assert f"splitserve up: --port {port} on 127.0.0.1 cannot be bound" in done.stderr, \
        done.stderr[-2000:]
    assert "[prefill]" not in done.stdout and "Traceback" not in done.stderr


@pytest.mark.parametrize("options", ["gateway", "worker"])
def test_no_grpc_server_of_ours_shares_a_taken_port(options, tiny_llama_dir):
    """Where the check before start-up passes and the port is taken after (or the holder
    lets others share it), the bind itself fails: grpc's default bound beside the holder."""
    chosen = (server_options(_config(tiny_llama_dir)) if options == "gateway"
              else GRPC_OPTIONS)

    async def bind(port: int) -> int:
        server = grpc.aio.server(options=chosen)
        try:
            return server.add_insecure_port(f"127.0.0.1:{port}")
        except RuntimeError:  # grpc's "Failed to bind"
            return 0

    with held_port() as port:
        assert asyncio.run(bind(port)) == 0


def _config(model_dir, **kwargs) -> GatewayConfig:
    return GatewayConfig(model=str(model_dir), worker=("127.0.0.1:1",), **kwargs)


def test_a_port_out_of_range_is_named_by_its_own_flag(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"^--port must be in \[0, 65535\]"):
        _config(tiny_llama_dir, port=99999)  # it said "--admin-port must be a port"
    with pytest.raises(ValueError, match=r"^--grpc-port must be in"):
        _config(tiny_llama_dir, grpc_port=70000)
