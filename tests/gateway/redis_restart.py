"""Restarting a test's redis-server on the port it had, so that clients configured with its
URL see Redis go away and come back. The process is the test's own child, stopped by handle."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path


class RestartedRedis:
    def __init__(self, port: int, workdir: Path) -> None:
        self.port = port
        self.process = subprocess.Popen(
            [shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", str(workdir), "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not _answers_ping(port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not restart on port {port}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)


def kill(server) -> None:
    """SIGKILL a redis server (a conftest RedisServer or a RestartedRedis) and wait for it."""
    server.process.kill()
    server.process.wait(timeout=5)


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False
