"""A role-both worker's own OpenAI-compatible port (--openai-port): the openai SDK talks to it
directly, bad input is a 400 that leaves it serving, it carries the worker's /metrics for an
endpoint picker, it dies with its worker, and without the flag nothing more listens."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from services.common.worker_config import WorkerConfig
from tests.conftest import _free_port
from tests.gateway.gateway_processes import openai_client, start_worker

MODEL = "smollm2-135m-instruct"


def child_pids(pid: int) -> set[int]:
    """The children of process `pid`, from every thread's list in /proc (a thread that ends
    while they are read had none left: a CI run met one)."""
    children: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children.update(int(c) for c in (task / "children").read_text().split())
        except FileNotFoundError:
            continue
    return children


def listening_ports(pid: int) -> set[int]:
    """TCP ports that process `pid` and its children hold in LISTEN state (from /proc)."""
    pids = {pid} | child_pids(pid)
    inodes = set()
    for p in pids:
        try:
            fds = list(Path(f"/proc/{p}/fd").iterdir())
        except FileNotFoundError:
            continue  # a child that has exited since
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def worker_ports(worker) -> set[int]:
    return {int(worker.address.rsplit(":", 1)[1]),
            int(worker.field("metrics").rsplit(":", 1)[1]),
            int(worker.field("kv").rsplit(":", 1)[1])}


def wait_serving(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url}/health never answered 200")


@pytest.fixture(scope="module")
def endpoint(smollm2_dir):
    port = _free_port()
    worker = start_worker(smollm2_dir, "both", "--openai-port", str(port)).wait_ready()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_serving(url)
        yield worker, port, url
    finally:
        worker.stop()


def test_openai_sdk_gets_a_completion_and_a_streamed_chat(endpoint):
    _, _, url = endpoint
    client = openai_client(url)
    assert [m.id for m in client.models.list().data] == [MODEL]
    completion = client.completions.create(model=MODEL, prompt="The capital of France is",
                                           max_tokens=8, temperature=0)
    assert completion.choices[0].text and completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 8
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=12,
        temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text and finish in (["stop"], ["length"])
    assert chunks[-1].usage.completion_tokens >= 1
    # vLLM's /ping is this worker's /health (503 while it starts or drains), not the gateway's.
    assert httpx.post(f"{url}/ping", timeout=5).json() == {"status": "ok"}


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (b'{"model": "smollm2-135m-instruct", "prompt": "hi", "max_tokens": -3}', "max_tokens"),
    (b'{"model": "smollm2-135m-instruct", "prompt": "hi", "temperature": "hot"}', "temperature"),
    (b'{"model": "smollm2-135m-instruct"}', "prompt"),
])
def test_bad_request_is_a_400_and_the_worker_keeps_serving(endpoint, body, param):
    worker, _, url = endpoint
    response = httpx.post(f"{url}/v1/completions", content=body,
                          headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param:
        assert error["param"] == param
    good = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "Hello", "max_tokens": 2})
    assert good.status_code == 200 and worker.alive()


def test_the_port_carries_the_workers_metrics_for_an_endpoint_picker(endpoint):
    worker, _, url = endpoint
    text = httpx.get(f"{url}/metrics", timeout=10).text
    # What the Gateway API Inference Extension's picker scrapes from the port it routes to.
    waiting = [line for line in text.splitlines() if line.startswith("vllm:num_requests_waiting{")]
    assert len(waiting) == 1 and f'model_name="{MODEL}"' in waiting[0]
    assert "\nvllm:kv_cache_usage_perc{" in text
    own = httpx.get(f"http://{worker.field('metrics')}/metrics", timeout=10).text
    families = [line for line in text.splitlines() if line.startswith("# TYPE")]
    assert families == [line for line in own.splitlines() if line.startswith("# TYPE")]


def test_flag_off_nothing_more_listens(smollm2_dir, endpoint):
    on_worker, port, _ = endpoint
    assert listening_ports(on_worker.process.pid) == worker_ports(on_worker) | {port}
    off = start_worker(smollm2_dir, "both").wait_ready()
    try:
        assert listening_ports(off.process.pid) == worker_ports(off)
    finally:
        off.stop()


def test_the_endpoint_dies_with_its_worker(endpoint):
    """Last in this module: it kills the shared worker (SIGKILL, no drain)."""
    worker, port, _ = endpoint
    assert port in listening_ports(worker.process.pid)
    worker.process.send_signal(signal.SIGKILL)
    worker.process.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
        except httpx.ConnectError:
            return
        time.sleep(0.1)
    raise AssertionError(f"port {port} still answers after its worker was killed")


def test_a_dead_endpoint_fails_the_workers_liveness(smollm2_dir):
    port = _free_port()
    worker = start_worker(smollm2_dir, "both", "--openai-port", str(port)).wait_ready()
    try:
        wait_serving(f"http://127.0.0.1:{port}")
        liveness = f"http://{worker.field('metrics')}/health"
        assert httpx.get(liveness, timeout=5).status_code == 200
        (child,) = child_pids(worker.process.pid)
        os.kill(child, signal.SIGKILL)  # the worker's own child, by its pid
        deadline = time.monotonic() + 10
        while httpx.get(liveness, timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "liveness still 200 with the endpoint dead"
            time.sleep(0.1)
        assert worker.alive()  # the engine keeps serving gRPC; the kubelet restarts the pod
    finally:
        worker.stop()


@pytest.mark.parametrize("overrides, message", [
    ({"role": "decode", "openai_port": 8100}, "needs --role both"),
    ({"openai_port": 70000}, "must be a port"),
    ({"openai_port": 50051}, "must differ from --port"),
])
def test_bad_openai_port_settings_are_refused(smollm2_dir, overrides, message):
    with pytest.raises(ValueError, match=message):
        WorkerConfig(**{"role": "both", "model": str(smollm2_dir), **overrides})


def test_a_normal_stop_ends_the_endpoint_cleanly(smollm2_dir):
    """SIGTERM to the worker: its endpoint child ended with "Fatal Python error:
    _enter_buffered_busy" every time, a daemon thread still blocked reading its stdin (the
    parent watch) at interpreter exit (a CLI audit)."""
    port = _free_port()
    worker = start_worker(smollm2_dir, "both", "--openai-port", str(port)).wait_ready()
    try:
        wait_serving(f"http://127.0.0.1:{port}")
    finally:
        worker.stop()
    time.sleep(1.0)  # the endpoint's last lines reach the reader
    assert worker.process.returncode == 0
    assert "Fatal Python error" not in worker.output(), worker.output()[-2000:]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
