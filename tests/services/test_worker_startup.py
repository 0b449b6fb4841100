"""A worker reports its start-up by phase, in its ready line and on /metrics; the phases tile
the wall time from its process start to that line."""

from __future__ import annotations

import re
import time

import pytest

from services.common.startup import PHASES, parse_ready_fields
from splitserve_cli.processes import start_worker
from tests.metrics_text import scrape_worker

pytestmark = pytest.mark.timeout(180)


def ready_fields(worker) -> dict[str, str]:
    line = next(line for line in worker.lines if line.startswith("SPLITSERVE_READY"))
    return dict(f.split("=", 1) for f in line.split()[3:] if "=" in f)


@pytest.mark.parametrize("role", ["prefill", "decode", "both"])
def test_startup_phases_tile_process_start_to_ready(tiny_llama_dir, role):
    started = time.monotonic()
    worker = start_worker(role, tiny_llama_dir, "--num-kv-blocks", "32")
    seen_ready_after = time.monotonic() - started
    try:
        fields = ready_fields(worker)
        phases = parse_ready_fields(fields)
        assert list(phases) == list(PHASES)
        assert all(seconds >= 0 for seconds in phases.values()), phases
        assert phases["weight_load"] > 0 and phases["imports"] > 0, phases
        total = float(fields["startup_s"])
        # Rounded to the millisecond each in the line.
        assert sum(phases.values()) == pytest.approx(total, abs=0.001 * (len(PHASES) + 1))
        # The process starts after Popen is called and prints before this process reads the
        # line; /proc's start time has 10 ms ticks; a loaded machine delays the reader thread.
        assert total <= seen_ready_after + 0.05
        assert total >= 0.8 * seen_ready_after - 0.5, (total, seen_ready_after)

        metrics = scrape_worker(worker)
        for phase, seconds in phases.items():
            gauge = metrics[f'splitserve_worker_startup_seconds{{model="{tiny_llama_dir.name}",'
                            f'phase="{phase}",role="{role}"}}']
            assert gauge == pytest.approx(seconds, abs=0.0006)
    finally:
        worker.kill()


def test_the_memory_profile_step_is_its_own_phase(tiny_llama_dir):
    """Sized from a profile step (no --num-kv-blocks), the step's time is booked as
    memory_profile, not in kv_allocation; with --num-kv-blocks no step runs (the test above)."""
    worker = start_worker("both", tiny_llama_dir, "--kv-cache-memory", "16MiB")
    try:
        phases = parse_ready_fields(ready_fields(worker))
        assert phases["memory_profile"] > 0, phases
        profiled = next(line for line in worker.lines if "requests/" in line and "s (weights" in line)
        seconds = float(profiled.split("requests/")[1].split("s (weights")[0])
        assert phases["memory_profile"] == pytest.approx(seconds, abs=0.006), (phases, profiled)
    finally:
        worker.kill()


def test_a_worker_freezes_what_start_up_allocated(tiny_llama_dir):
    """Start-up's objects (modules, torch's, gRPC's) live as long as the process; frozen at
    ready (gc.freeze), a full collection no longer walks them in the middle of a step."""
    worker = start_worker("both", tiny_llama_dir, "--num-kv-blocks", "32")
    try:
        line = next(line for line in worker.lines if "gc.freeze" in line)
        assert int(re.search(r"\(gc\.freeze\): (\d+)", line).group(1)) > 10_000, line
    finally:
        worker.kill()


@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
def test_a_port_another_process_holds_is_refused_before_the_model_loads(tiny_llama_dir, flag):
    """It was a traceback from gRPC (or the metrics server) after the whole start-up."""
    import socket
    import subprocess
    import sys

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        others = ["--port", "0"] if flag == "--metrics-port" else []
        done = subprocess.run(
            [sys.executable, "-m", "splitserve_cli.main", "worker", "--role", "both",
             "--model", str(tiny_llama_dir), flag, str(port), *others],
            capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert f"{flag} {port} on 127.0.0.1 cannot be bound" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "weight_load" not in done.stderr
