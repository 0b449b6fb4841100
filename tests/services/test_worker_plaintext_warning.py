"""A worker serving gRPC without TLS on an address other hosts may reach says so at start:
anyone who reaches that port can run requests past the gateway's API keys and quotas (a
security audit called workers directly). On loopback, as `splitserve up` starts them, it does
not."""

from __future__ import annotations

import time

import pytest

from splitserve_cli.processes import start_worker

pytestmark = pytest.mark.timeout(120)
WARNING = "serves without TLS on an address other hosts may reach"


@pytest.mark.parametrize(("host", "warned"), [("0.0.0.0", True), ("127.0.0.1", False)])
def test_a_plaintext_worker_on_a_reachable_address_warns(tiny_llama_dir, host, warned):
    worker = start_worker("prefill", tiny_llama_dir, "--host", host, "--metrics-port", "-1")
    try:
        time.sleep(0.3)  # the log line is written before the READY line; let the pipe catch up
        assert any(WARNING in line for line in worker.lines) == warned, list(worker.lines)
    finally:
        worker.kill()
