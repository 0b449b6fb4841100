"""The worker's status server (/metrics, /health, /ready) writes nothing to stderr when a probe
or scrape client gives up before its answer (a step held the GIL past the client's timeout):
socketserver's default printed a multi-line traceback per such request, breaking the JSON log
stream (12 of them, 252 lines, in an audit that paused a worker for 10 s). Also: the process
series every Prometheus client exports (process_resident_memory_bytes, ...) are there."""

from __future__ import annotations

import contextlib
import io
import socket
import struct
import time
import urllib.request

from services.common.metrics import process_registry
from services.common.status_server import StatusServer


def test_a_client_that_left_leaves_no_traceback_and_process_series_are_exported():
    server = StatusServer("127.0.0.1", 0, process_registry(), lambda: True, lambda: True)
    server.start()
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            for _ in range(20):
                client = socket.create_connection(("127.0.0.1", server.port))
                # Closed with a reset the moment the request is out: the answer meets no reader.
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                client.send(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                client.close()
            time.sleep(0.5)
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as r:
            text = r.read().decode()
    finally:
        server.close()
    assert stderr.getvalue() == ""
    for name in ("process_resident_memory_bytes", "process_open_fds", "python_gc_objects_collected_total"):
        assert f"\n{name}" in text, name
