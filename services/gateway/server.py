"""Runs the gateway process: worker health polling, the HTTP API on uvicorn and the optional
gRPC front door, all on one asyncio event loop; SIGTERM/SIGINT drain and stop it."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket

import grpc
import uvicorn

from services.common.addresses import address_family, check_ports_free, host_port
from services.common.logs import setup_logging
from services.common.security import add_port
from services.common.tracing import setup_tracing, shutdown_tracing
from services.gateway.api import grpc as grpc_api
from services.gateway.api.connections import (
    connection_protocol,
    default_max_connections,
    raise_open_file_limit,
)
from services.gateway.api.http import create_admin_app, create_app
from services.gateway.api.streaming import cut_off_filter
from services.gateway.config import GatewayConfig
from services.gateway.gateway import Gateway

log = logging.getLogger("splitserve.gateway")


class _Server(uvicorn.Server):
    # The process owns its signals (see _serve); uvicorn would re-raise them after exit.
    def capture_signals(self):
        import contextlib

        return contextlib.nullcontext()


def _listen(host: str, port: int, send_buffer: int) -> socket.socket:
    # proto IPPROTO_TCP, inherited by accepted sockets, is what makes asyncio set TCP_NODELAY
    # on them; with proto 0 a response's header and body writes meet Nagle and the client's
    # delayed ACK (+40 ms per non-streamed response).
    sock = socket.socket(address_family(host), socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if send_buffer:
        # Accepted connections inherit it: a small buffer makes slow clients visible sooner.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def serve(config: GatewayConfig) -> None:
    gateway = Gateway(config)
    await gateway.start()
    sock = _listen(config.host, config.port, config.socket_send_buffer)
    open_files = raise_open_file_limit()
    max_connections = config.max_connections or default_max_connections(open_files)
    closed = gateway.observer.metrics.connections_closed
    http_port = sock.getsockname()[1]
    # uvicorn's own log config would give its loggers plain-text handlers of their own: its
    # lines went out as "ERROR:    ..." between the JSON ones. None: they reach the root
    # logger's handler (setup_logging), and its format.
    logging.getLogger("uvicorn.error").addFilter(cut_off_filter)
    server = _Server(uvicorn.Config(
        create_app(gateway), log_level=config.log_level.lower(), access_log=False,
        log_config=None,
        timeout_graceful_shutdown=max(1, int(config.shutdown_grace_s)), lifespan="off",
        http=connection_protocol(config.request_read_timeout_s, max_connections,
                                 lambda reason: closed.labels(reason).inc(),
                                 flush_timeout_s=config.slow_client_timeout_s),
        timeout_keep_alive=config.keep_alive_timeout_s,
        # The peer stays the peer: uvicorn would take X-Forwarded-For from 127.0.0.1 on its
        # own; which proxies may name the client is --forwarded-allow-ips' (client_address.py).
        proxy_headers=False,
    ))
    gateway.observer.metrics.open_connections.set_function(
        lambda: len(server.server_state.connections))
    # /metrics, /ready and /openapi.json: their own listener, 127.0.0.1 by default.
    admin = admin_sock = None
    admin_address = ""
    if config.admin_listen_port >= 0:
        admin_sock = _listen(config.admin_host, config.admin_listen_port, 0)
        admin_address = host_port(config.admin_host, admin_sock.getsockname()[1])
        admin = _Server(uvicorn.Config(create_admin_app(gateway), log_level="warning",
                                       log_config=None, access_log=False, lifespan="off",
                                       http="h11",
                                       timeout_graceful_shutdown=1))
    grpc_server = grpc_health = None
    grpc_address = ""
    if config.grpc_port >= 0:
        grpc_server = grpc.aio.server(options=grpc_api.server_options(config))
        grpc_api.add_to_server(gateway, grpc_server)
        grpc_health = grpc_api.add_health(gateway, grpc_server)
        try:
            grpc_port = add_port(grpc_server, host_port(config.host, config.grpc_port),
                                 config.tls, require_client_cert=config.grpc_client_certs)
        except RuntimeError:  # taken since the check in run_gateway
            grpc_port = 0
        if grpc_port == 0:
            raise SystemExit(f"splitserve gateway: --grpc-port {config.grpc_port} on "
                             f"{config.host} cannot be bound")
        await grpc_server.start()
        grpc_address = host_port(config.host, grpc_port)

    loop = asyncio.get_running_loop()

    grpc_stopping: list[asyncio.Task] = []

    def stop() -> None:
        # Drain: not ready, no new connections or RPCs, open streams finish within the grace.
        log.info("stopping: finishing requests in flight (grace %.0fs)", config.shutdown_grace_s)
        gateway.draining = True
        gateway.cutoff.drain(config.shutdown_grace_s)
        server.should_exit = True
        if grpc_server is not None and not grpc_stopping:
            grpc_stopping.append(asyncio.ensure_future(grpc_server.stop(config.shutdown_grace_s)))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    # Re-read the tenants and API-keys files now (they are also checked every
    # --tenants-reload-s).
    loop.add_signal_handler(signal.SIGHUP, gateway.tenants_watch.reload)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    admin_serving = asyncio.create_task(admin.serve(sockets=[admin_sock])) if admin else None
    while not server.started and not serving.done():
        await asyncio.sleep(0.02)
    while admin and not admin.started and not admin_serving.done():
        await asyncio.sleep(0.02)
    if server.started:
        mode = "disaggregated" if config.disaggregated else "aggregated"
        log.info("gateway serving %s (%s) on http://%s%s", gateway.model_name, mode,
                 host_port(config.host, http_port), f" grpc={grpc_address}" if grpc_address else "")
        log.info("admin (/metrics, /ready): %s", f"http://{admin_address}" if admin else "off")
        log.info("client connections: at most %d open (open-file limit %d), headers and body "
                 "each within %s, kept alive %g s idle", max_connections, open_files,
                 f"{config.request_read_timeout_s:g} s" if config.request_read_timeout_s
                 else "any time", config.keep_alive_timeout_s)
        # What start-up allocated (the tokenizer, modules, config) lives as long as the
        # process: out of the collector's sight, a full collection no longer walks it while
        # requests wait (tens of ms on a loaded core).
        gc.freeze()
        # A line launchers and tests wait for.
        print(f"SPLITSERVE_READY gateway {host_port(config.host, http_port)} grpc={grpc_address} "
              f"admin={admin_address}", flush=True)
    try:
        await serving
    finally:
        if admin is not None:  # after the public port: /ready says 503 while draining
            admin.should_exit = True
            await admin_serving
        if grpc_stopping:
            await grpc_stopping[0]
        elif grpc_server is not None:
            await grpc_server.stop(config.shutdown_grace_s)
        if grpc_health is not None:
            grpc_health.cancel()
        await gateway.close()


def run_gateway(config: GatewayConfig) -> int:
    setup_logging("gateway", config.log_level, config.log_format)
    log.info("config %s", config.describe())
    # Before the tokenizer loads and the workers are polled; named by flag (a taken --port was
    # "[Errno 98] Address already in use", and a taken --grpc-port was shared, see grpc.py).
    check_ports_free("splitserve gateway", [
        ("--port", config.host, config.port),
        ("--admin-port", config.admin_host, config.admin_listen_port),
        ("--grpc-port", config.host, config.grpc_port)])
    tracing = setup_tracing("splitserve-gateway")
    try:
        asyncio.run(serve(config))
    finally:
        if tracing:
            shutdown_tracing()
    return 0
