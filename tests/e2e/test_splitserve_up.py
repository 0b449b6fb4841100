"""`splitserve up` (what `make run` runs): a whole local deployment that answers through the
OpenAI SDK and leaves no process behind when stopped, by SIGTERM or even by SIGKILL."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import shipped_env

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 300.0


class Launcher:
    """A `splitserve up` child; records the PIDs of the processes it starts."""

    def __init__(self, *args: str) -> None:
        self.lines: list[str] = []
        self.url = ""
        self.child_pids: dict[str, int] = {}
        self._up = threading.Event()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "splitserve_cli.main", "up", *args], cwd=REPO_ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
            env=shipped_env())  # what `make run` starts: the shipped dtype
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)
            if match := re.match(r"\[up\] started (\w+) pid=(\d+)", line):
                self.child_pids[match.group(1)] = int(match.group(2))
            if line.startswith("SPLITSERVE_UP "):
                self.url = line.split()[1]
                self._up.set()

    def wait_up(self) -> str:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._up.wait(0.2):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("splitserve up did not come up:\n" + "".join(self.lines[-60:]))
        return self.url

    def alive_children(self) -> list[str]:
        return [name for name, pid in self.child_pids.items() if _alive(pid)]

    def cleanup(self) -> None:
        # Our own launcher and the children it reported, each by PID.
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)
        for pid in self.child_pids.values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _secret_files(launcher: Launcher) -> set[str]:
    """The --cluster-secret-file each child process was started with."""
    paths = set()
    for name, pid in launcher.child_pids.items():
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode().split("\0")
        assert "--cluster-secret-file" in argv, (name, argv)
        paths.add(argv[argv.index("--cluster-secret-file") + 1])
    return paths


def _check_one_private_secret(launcher: Launcher) -> str:
    """Every process of the deployment shares one fresh secret only this user can read."""
    paths = _secret_files(launcher)
    assert len(paths) == 1, paths
    path = paths.pop()
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(os.path.dirname(path)).st_mode & 0o077 == 0
    with open(path) as f:
        secret = f.read()
    assert len(bytes.fromhex(secret)) == 32
    assert secret not in "".join(launcher.lines)  # never printed
    return path


def _wait_until_gone(launcher: Launcher, timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    while launcher.alive_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    return launcher.alive_children()


def _burst_cancel_bad_then_small(url: str, model: str) -> None:
    """What a new user tries first, against the defaults: a burst of 32 streams (128-token
    prompts, 128 tokens out), a stream cut after its first chunk, a bad request; then one
    small request must still be served. Each burst request is served in full or refused with
    a Retry-After; none fails otherwise, and nothing locks the gateway out afterwards."""
    import asyncio

    import httpx

    async def stream(client: httpx.AsyncClient, index: int, cut: bool = False):
        body = {"model": model, "prompt": [1000 + index] + [500 + i for i in range(127)],
                "max_tokens": 128, "stream": True, "ignore_eos": True, "temperature": 0}
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return response.status_code, response.headers.get("retry-after"), 0
            chunks = 0
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    if cut:
                        return 200, None, chunks
            return 200, None, chunks

    async def burst():
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=None)) as client:
            results = await asyncio.gather(*(stream(client, i) for i in range(32)))
            await stream(client, 99, cut=True)
            bad = await client.post(f"{url}/v1/completions", json={"model": model, "prompt": "x",
                                                                   "max_tokens": -3})
            small = await client.post(f"{url}/v1/completions", json={
                "model": model, "prompt": "Hi", "max_tokens": 4, "ignore_eos": True})
            return results, bad, small

    results, bad, small = asyncio.run(burst())
    served = [r for r in results if r[0] == 200]
    assert served and all(chunks >= 128 for _, _, chunks in served), results
    assert all(status in (429, 503) and retry for status, retry, _ in results
               if status != 200), results
    assert bad.status_code == 400 and bad.json()["error"]["param"], bad.text
    assert small.status_code == 200, small.text
    assert small.json()["usage"]["completion_tokens"] == 4


@pytest.mark.slow
def test_up_with_smollm2_says_paris_and_stops_cleanly(smollm2_dir):
    from openai import OpenAI

    launcher = Launcher("--port", "0", "--model", str(smollm2_dir))
    try:
        url = launcher.wait_up()
        assert set(launcher.child_pids) == {"prefill", "decode", "gateway"}
        # The workers split the cores and lend them to each other (services/common/core_share.py).
        shares = {re.search(r"core_share=(\S*)", line).group(1) for line in launcher.lines
                  if line.startswith(("[prefill]", "[decode]")) and "core_share=" in line}
        assert len(shares) == 1 and shares.pop().endswith("/cores"), shares
        # The KV channel between the workers is authenticated with it: Paris below proves it.
        secret_file = _check_one_private_secret(launcher)
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        question = [{"role": "user", "content": "What is the capital of France?"}]
        answer = client.chat.completions.create(model=smollm2_dir.name, messages=question,
                                                max_tokens=30, temperature=0)
        assert "Paris" in answer.choices[0].message.content
        streamed = "".join(
            chunk.choices[0].delta.content or ""
            for chunk in client.chat.completions.create(
                model=smollm2_dir.name, messages=question, max_tokens=30, temperature=0,
                stream=True))
        assert streamed == answer.choices[0].message.content
        _burst_cancel_bad_then_small(url, smollm2_dir.name)
        launcher.process.send_signal(signal.SIGTERM)
        assert launcher.process.wait(60) == 0
        assert _wait_until_gone(launcher, 10) == []
        assert not os.path.exists(secret_file)
    finally:
        launcher.cleanup()


def test_up_aggregated_leaves_no_orphans_even_when_killed(tiny_llama_dir):
    launcher = Launcher("--port", "0", "--model", str(tiny_llama_dir), "--mode", "agg")
    try:
        url = launcher.wait_up()
        assert set(launcher.child_pids) == {"both", "gateway"}
        first_secret = open(_check_one_private_secret(launcher)).read()
        import httpx

        response = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": tiny_llama_dir.name, "prompt": "hi", "max_tokens": 4})
        assert response.json()["usage"]["completion_tokens"] == 4
        launcher.process.kill()  # no chance to clean up: the children must still go
        launcher.process.wait(10)
        assert _wait_until_gone(launcher, 20) == []
    finally:
        launcher.cleanup()
    again = Launcher("--port", "0", "--model", str(tiny_llama_dir), "--mode", "agg",
                     "--served-model-name", "acme/tiny")
    try:
        url = again.wait_up()
        # Each deployment draws its own secret.
        assert open(_check_one_private_secret(again)).read() != first_secret
        # --served-model-name reaches the gateway (and the worker's metrics label).
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["acme/tiny"]
        response = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "acme/tiny", "prompt": "hi", "max_tokens": 2})
        assert response.status_code == 200, response.text
    finally:
        again.cleanup()
