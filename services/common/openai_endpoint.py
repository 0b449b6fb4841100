"""A worker's own OpenAI-compatible HTTP port (--openai-port): the gateway's API code in a child
process the worker owns, routed to this worker alone, so a pool of workers can sit behind an
endpoint picker (Gateway API Inference Extension, llm-d) as well as behind our gateway."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Sequence
from typing import TYPE_CHECKING

from services.common import tracing
from services.common.addresses import address_family, host_port

if TYPE_CHECKING:
    from services.common.worker_config import WorkerConfig

log = logging.getLogger("splitserve.openai_endpoint")
STOP_TIMEOUT_S = 5.0  # past the drain grace: how long close() waits before killing the child


def dial_host(host: str) -> str:
    """Where a process on this machine reaches a port bound to `host`."""
    return "127.0.0.1" if host in ("", "0.0.0.0") else "::1" if host == "::" else host


class OpenAIEndpoint:
    """The worker's side: binds the port (so a taken port fails the worker's start, and clients
    that connect while the child starts wait in the backlog instead of being refused), starts
    the child with that socket, and stops it. Used from the worker's event loop; the child dies
    with the worker even on SIGKILL (it exits when its stdin, a pipe from here, closes)."""

    def __init__(self, host: str, port: int) -> None:
        self.sock = socket.socket(address_family(host), socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as exc:
            self.sock.close()
            raise RuntimeError(f"--openai-port: cannot listen on {host}:{port} ({exc})") from None
        self.sock.listen(2048)
        self.address = host_port(host, self.sock.getsockname()[1])
        self.process: subprocess.Popen | None = None
        self.stopping = False

    def start(self, gateway_args: Sequence[str], metrics_url: str) -> None:
        """`gateway_args`: `splitserve gateway` flags for the child (see gateway_args)."""
        fd = self.sock.fileno()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "services.common.openai_endpoint", "--listen-fd", str(fd),
             "--worker-metrics-url", metrics_url, *gateway_args],
            stdin=subprocess.PIPE, pass_fds=(fd,), start_new_session=True,
        )
        log.info("OpenAI-compatible endpoint on http://%s (pid %d)", self.address,
                 self.process.pid)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def healthy(self) -> bool:
        """Running, or gone because the worker asked (a drained child exits early)."""
        return self.alive or self.stopping

    def drain(self) -> None:
        """Refuse new connections; requests in flight finish within the child's grace."""
        self.stopping = True
        if self.alive:
            self.process.send_signal(signal.SIGTERM)

    def close(self) -> None:
        if self.process is not None:
            self.drain()
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(STOP_TIMEOUT_S)
            if self.process.stdin is not None:
                self.process.stdin.close()
        self.sock.close()


def gateway_args(*, model: str, served_model_name: str, grpc_address: str, port: int,
                 tls: tuple[str, str, str], grace_s: float, log_level: str,
                 log_format: str) -> list[str]:
    """The child's gateway: this worker alone (aggregated), no Redis discovery, no admin or
    gRPC port, no early rejection on a TTFT guess (the endpoint picker in front decides where
    load goes; the worker's capacity rule still holds requests it cannot batch). Every other
    setting (API keys, tenants, request limits, timeouts) is the gateway's, from its
    SPLITSERVE_GATEWAY_* environment."""
    cert, key, ca = tls
    return ["--model", model, "--served-model-name", served_model_name,
            "--worker", grpc_address, "--prefill", "", "--decode", "", "--redis-url", "",
            "--cluster-secret-file", "", "--port", str(port), "--admin-port", "-1",
            "--grpc-port", "-1", "--ttft-target-s", "0", "--shutdown-grace-s", str(grace_s),
            "--tls-cert", cert, "--tls-key", key, "--tls-ca", ca,
            "--log-level", log_level, "--log-format", log_format]


def start_openai_endpoint(config: WorkerConfig, grpc_port: int,
                          metrics_port: int | None) -> OpenAIEndpoint:
    """The endpoint of a worker that serves gRPC on `grpc_port` (and /metrics on
    `metrics_port`, None: off), listening on --host:--openai-port."""
    endpoint = OpenAIEndpoint(config.host, config.openai_port)
    # With mutual TLS the worker's certificate names its advertised host: dial that.
    host = config.public_host if config.tls.enabled else dial_host(config.host)
    metrics_url = (f"http://{host_port(dial_host(config.host), metrics_port)}/metrics"
                   if metrics_port is not None else "")
    endpoint.start(gateway_args(
        model=config.model, served_model_name=config.served_name,
        grpc_address=host_port(host, grpc_port), port=config.openai_port,
        tls=(config.tls_cert, config.tls_key, config.tls_ca), grace_s=config.drain_grace_s,
        log_level=config.log_level, log_format=config.log_format), metrics_url)
    return endpoint


# --- the child process -----------------------------------------------------------------------


def endpoint_app(gateway, metrics_url: str):
    """The gateway's public app, with /health answering for this worker (503 until it serves
    and while it drains) and /metrics relaying the worker's own (an endpoint picker scrapes its
    vllm:* series from the port it routes to)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response

    from services.gateway.api.http import create_app
    from services.gateway.errors import APIError

    app = FastAPI(title="splitserve worker", docs_url=None, redoc_url=None, openapi_url=None,
                  telemetry=tracing.FASTAPI_TELEMETRY_OFF)

    @app.get("/health")
    async def health() -> JSONResponse:
        if gateway.router.ready() and not gateway.draining:
            return JSONResponse({"status": "ok"})
        error = APIError.overloaded("This worker is not serving (starting or draining).", 1)
        return JSONResponse(error.body(), 503, headers=error.headers())

    app.add_api_route("/ping", health, methods=["GET", "POST"])  # vLLM's name for it

    @app.get("/metrics")
    async def metrics() -> Response:
        if not metrics_url:
            return JSONResponse(APIError.not_found("/metrics").body(), 404)
        try:
            status, body, content_type = await asyncio.to_thread(_fetch, metrics_url)
        except OSError as exc:
            error = APIError.overloaded(f"the worker's metrics are not reachable ({exc})", 1)
            return JSONResponse(error.body(), 503, headers=error.headers())
        return Response(body, status, media_type=content_type)

    app.mount("/", create_app(gateway))
    return app


def _fetch(url: str) -> tuple[int, bytes, str]:
    with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 (our own http URL)
        return response.status, response.read(), response.headers.get("Content-Type", "")


async def _serve(config, sock: socket.socket, metrics_url: str) -> None:
    import uvicorn

    from services.gateway.gateway import Gateway

    class Server(uvicorn.Server):
        def capture_signals(self):  # this process owns its signals (below)
            return contextlib.nullcontext()

    gateway = Gateway(config)
    await gateway.start()
    server = Server(uvicorn.Config(
        endpoint_app(gateway, metrics_url), log_level=config.log_level.lower(),
        access_log=False, lifespan="off", http="h11", log_config=None,  # the JSON handler
        timeout_graceful_shutdown=max(1, int(config.shutdown_grace_s))))
    loop = asyncio.get_running_loop()

    def stop(now: bool = False) -> None:
        gateway.draining = True
        server.should_exit = True
        server.force_exit = server.force_exit or now

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)

    def watch_parent() -> None:
        # EOF: the worker is gone, and with it every stream. os.read, not sys.stdin's buffer:
        # a daemon thread still blocked holding the buffer's lock at interpreter exit made
        # every normal stop end in "Fatal Python error: _enter_buffered_busy" (a CLI audit).
        while os.read(sys.stdin.fileno(), 1 << 12):
            pass
        loop.call_soon_threadsafe(stop, True)

    threading.Thread(target=watch_parent, name="parent-watch", daemon=True).start()
    try:
        await server.serve(sockets=[sock])
    finally:
        await gateway.close()


def main(argv: Sequence[str] | None = None) -> int:
    from services.common.logs import setup_logging
    from services.gateway.config import add_gateway_arguments, gateway_config_from_args

    parser = argparse.ArgumentParser(prog="splitserve-openai-endpoint")
    parser.add_argument("--listen-fd", type=int, required=True)
    parser.add_argument("--worker-metrics-url", default="")
    add_gateway_arguments(parser)
    args = parser.parse_args(argv)
    config = gateway_config_from_args(args)
    setup_logging("openai-endpoint", config.log_level, config.log_format)
    sock = socket.socket(fileno=args.listen_fd)
    sock.setblocking(False)
    os.set_inheritable(sock.fileno(), False)
    asyncio.run(_serve(config, sock, args.worker_metrics_url))
    return 0


if __name__ == "__main__":
    sys.exit(main())
