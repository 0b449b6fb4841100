"""A small HTTP server on each worker for operators and Kubernetes probes:
/metrics (Prometheus text), /health (liveness), /ready (readiness; false while draining or
while an engine step runs past --step-timeout-s).

Runs on its own daemon thread; handlers only read thread-safe snapshots."""

from __future__ import annotations

import logging
import socket
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.common.addresses import address_family

log = logging.getLogger(__name__)


class StatusServer:
    def __init__(self, host: str, port: int, registry, is_live: Callable[[], bool],
                 is_ready: Callable[[], bool]) -> None:
        handler = _make_handler(registry, is_live, is_ready)
        server = _QuietIPv6HTTPServer if address_family(host) == socket.AF_INET6 else _QuietHTTPServer
        self.httpd = server((host, port), handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="status-http",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _QuietHTTPServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        # A probe or scrape whose client gave up (its timeout passed while a step held the
        # GIL) breaks the pipe: not worth the traceback socketserver prints on stderr, which
        # broke the JSON log stream.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            log.warning("status request from %s failed", client_address[0], exc_info=True)


class _QuietIPv6HTTPServer(_QuietHTTPServer):
    address_family = socket.AF_INET6


def _make_handler(registry, is_live, is_ready):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            path = self.path.split("?")[0]
            if path == "/metrics":
                self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif path == "/health":
                ok = is_live()
                self._send(200 if ok else 503, b"ok\n" if ok else b"unhealthy\n")
            elif path == "/ready":
                ok = is_ready()
                self._send(200 if ok else 503, b"ready\n" if ok else b"not ready\n")
            else:
                self._send(404, b"not found\n")

        def _send(self, status: int, body: bytes, content_type: str = "text/plain") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # probes every few seconds: keep logs quiet
            pass

    return Handler
