"""A small HTTP server on each worker for operators and Kubernetes probes:
/metrics (Prometheus text), /health (liveness), /ready (readiness; false while draining or
while an engine step runs past --step-timeout-s).

Runs on its own daemon thread; handlers only read thread-safe snapshots."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest


class StatusServer:
    def __init__(self, host: str, port: int, registry, is_live: Callable[[], bool],
                 is_ready: Callable[[], bool]) -> None:
        handler = _make_handler(registry, is_live, is_ready)
        server = _IPv6HTTPServer if ":" in host else ThreadingHTTPServer
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


class _IPv6HTTPServer(ThreadingHTTPServer):
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
