"""Request migration with real processes (a gateway, one prefill and two decode workers on the
tiny long-context model): kill -9 of a decode worker mid-stream, or its SIGTERM drain past
--drain-grace-s, moves its streams to the other decoder, and every stream's text is byte for
byte the text of the same request on an undisturbed run; with every decoder gone the stream
ends with the error event, and nothing hangs or leaks.

The workers run --dtype float32: in bfloat16 a request's tokens can depend on its batch
(engine/config.py), which an undisturbed run does not reproduce either."""

from __future__ import annotations

import json
import re
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from gateway_processes import start_gateway
from registry_cluster import wait_until

from splitserve_cli.processes import start_worker

pytestmark = pytest.mark.timeout(240)
FLAGS = ("--dtype", "float32", "--num-kv-blocks", "2048")


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> Path:
    """The tiny model with a long context: 16 streams of hundreds of tokens stay cheap."""
    from splitserve_cli.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-long"), arch="llama", seed=0,
                            max_position_embeddings=2048)


class Deployment:
    """Workers by name and one gateway over them (static addresses); closed by the fixture."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self.workers = {}
        self.gateway = None

    def start(self, *gateway_flags: str, decode_flags: tuple[str, ...] = ()) -> None:
        with ThreadPoolExecutor(3) as pool:
            p1 = pool.submit(start_worker, "prefill", self.model, *FLAGS)
            d1 = pool.submit(start_worker, "decode", self.model, *FLAGS, *decode_flags)
            d2 = pool.submit(start_worker, "decode", self.model, *FLAGS, *decode_flags)
            for name, future in (("p1", p1), ("d1", d1), ("d2", d2)):
                self.workers[name] = future.result()
        decoders = f"{self.workers['d1'].address},{self.workers['d2'].address}"
        self.gateway = start_gateway(self.model, "--prefill", self.workers["p1"].address,
                                     "--decode", decoders, "--ttft-target-s", "0",
                                     *gateway_flags)

    @property
    def url(self) -> str:
        return f"http://{self.gateway.address}"

    def close(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
        for worker in self.workers.values():
            worker.kill()

    def metric(self, name: str) -> float:
        text = httpx.get(f"http://{self.gateway.admin_address}/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))


@pytest.fixture
def deployment(long_model):
    deployment = Deployment(long_model)
    try:
        yield deployment
    finally:
        deployment.close()


@dataclass
class Result:
    status: int = 0
    texts: dict[int, str] = field(default_factory=dict)  # choice index -> text
    finish: dict[int, str] = field(default_factory=dict)
    logprob_tokens: dict[int, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    usage: dict | None = None


def request_body(i: int, model: str) -> dict:
    """Mixed requests: greedy and seeded sampling, penalties, n=2, logprobs, 96-512 tokens."""
    body = {"model": model, "prompt": [(i * 53 + j * 7) % 700 + 3 for j in range(8 + 4 * i)],
            "max_tokens": 96 + (i * 97) % 417, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if i % 2:
        body.update(temperature=0.8, top_p=0.9, seed=1000 + i)
    else:
        body.update(temperature=0)
    if i % 4 == 1:
        body.update(presence_penalty=0.5, frequency_penalty=0.3)
    if i == 3:
        body.update(n=2)
    if i == 5:
        body.update(logprobs=2)
    return body


def stream(url: str, body: dict, started: threading.Event | None = None) -> Result:
    result = Result()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        result.status = response.status_code
        if response.status_code != 200:
            result.errors.append(response.read().decode())
            return result
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                result.errors.append(event["error"]["message"])
                continue
            if event.get("usage"):
                result.usage = event["usage"]
            for choice in event.get("choices", []):
                index = choice["index"]
                result.texts[index] = result.texts.get(index, "") + choice["text"]
                if choice.get("logprobs"):
                    result.logprob_tokens[index] = (result.logprob_tokens.get(index, 0)
                                                    + len(choice["logprobs"]["tokens"]))
                if choice["finish_reason"]:
                    result.finish[index] = choice["finish_reason"]
            if started is not None and result.texts:
                started.set()
    return result


def mixed(model: str) -> list[dict]:
    return [request_body(i, model) for i in range(16)]


def long(model: str) -> list[dict]:
    """8 requests of 1800 tokens: several seconds on the tiny model, past a 1 s drain grace."""
    return [{**request_body(i, model), "max_tokens": 1800} for i in range(8)]


def stream_all(url: str, bodies: list[dict], while_streaming=None,
               finish: str = "length") -> list[Result]:
    """The requests at once, each answered 200 with no error event and every choice ending
    with `finish`; `while_streaming()` runs once every stream has tokens."""
    started = [threading.Event() for _ in bodies]
    with ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(stream, url, body, event)
                   for body, event in zip(bodies, started, strict=True)]
        if while_streaming is not None:
            for event in started:
                assert event.wait(60), "a stream never started"
            while_streaming()
        results = [f.result() for f in futures]
    for body, result in zip(bodies, results, strict=True):
        assert result.status == 200 and not result.errors, result
        assert result.finish == dict.fromkeys(range(body.get("n", 1)), finish), result
    return results


def run_all(url: str, bodies: list[dict], while_streaming=None) -> list[Result]:
    """stream_all of requests that run to max_tokens, with their usage and logprobs checked."""
    results = stream_all(url, bodies, while_streaming)
    for body, result in zip(bodies, results, strict=True):
        n = body.get("n", 1)
        assert result.usage["prompt_tokens"] == len(body["prompt"])
        assert result.usage["completion_tokens"] == n * body["max_tokens"]
        if "logprobs" in body:
            assert result.logprob_tokens == {0: body["max_tokens"]}
    return results


@dataclass
class Undisturbed:
    deployment: Deployment
    # Per request, choice index -> text: of mixed() and of long().
    texts: list[dict[int, str]]
    long_texts: list[dict[int, str]]


@pytest.fixture(scope="module")
def undisturbed(long_model):
    """The 16 requests' texts on a deployment nobody touched yet (the kill test then uses
    it: one start-up less)."""
    deployment = Deployment(long_model)
    try:
        deployment.start()
        yield Undisturbed(
            deployment, [r.texts for r in run_all(deployment.url, mixed(long_model.name))],
            [r.texts for r in run_all(deployment.url, long(long_model.name))])
    finally:
        deployment.close()


def assert_same_texts(results: list[Result], texts: list[dict[int, str]]) -> None:
    changed = [i for i, (r, u) in enumerate(zip(results, texts, strict=True)) if r.texts != u]
    assert not changed, f"streams {changed} differ from the undisturbed run"


def decoding_on(worker) -> int:
    return worker.health().stats.running


def kill_when_decoding(worker, streams: int = 2) -> None:
    """kill -9 once the worker decodes at least `streams` streams."""
    wait_until(lambda: decoding_on(worker) >= streams, timeout=30,
               what=f"streams decoding on {worker.address}", interval=0.02)
    worker.kill(signal.SIGKILL)


def test_kill_9_of_a_decode_worker_migrates_its_streams_unchanged(long_model, undisturbed):
    deployment = undisturbed.deployment
    d1 = deployment.workers["d1"]
    moved = {}

    def kill_d1():
        wait_until(lambda: decoding_on(d1) >= 2, timeout=30, what="streams decoding on d1",
                   interval=0.02)
        moved["streams"] = decoding_on(d1)
        d1.kill(signal.SIGKILL)

    results = run_all(deployment.url, mixed(long_model.name), kill_d1)
    assert_same_texts(results, undisturbed.texts)
    assert deployment.metric("splitserve_gateway_migrations_total") >= moved["streams"]
    assert any("migrated=worker_failed" in line for line in deployment.gateway.lines)


def test_sigterm_drain_past_its_grace_hands_streams_off_with_no_error(deployment, long_model,
                                                                       undisturbed):
    deployment.start(decode_flags=("--drain-grace-s", "1"))
    d1 = deployment.workers["d1"]

    def drain_d1():
        wait_until(lambda: decoding_on(d1) >= 2, timeout=30, what="streams decoding on d1",
                   interval=0.02)
        d1.process.send_signal(signal.SIGTERM)
        assert d1.process.wait(15) == 0, d1.output

    results = run_all(deployment.url, long(long_model.name), drain_d1)
    handed_off = re.search(r"drain grace over: (\d+) streams handed off", d1.output)
    assert handed_off, f"no stream outlived the grace: the hand-off was not tested\n{d1.output}"
    assert_same_texts(results, undisturbed.long_texts)
    assert deployment.metric("splitserve_gateway_migrations_total") >= int(handed_off[1]) >= 1
    assert any("migrated=draining" in line for line in deployment.gateway.lines)


def test_with_every_decoder_gone_the_stream_ends_with_the_error_event(deployment, long_model):
    deployment.start("--migration-limit", "2")
    d1, d2, p1 = (deployment.workers[n] for n in ("d1", "d2", "p1"))
    free_before = p1.health().stats.kv_blocks_free
    started = threading.Event()
    body = {**request_body(0, long_model.name), "max_tokens": 1500}
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(stream, deployment.url, body, started)
        assert started.wait(60)
        for worker in (d1, d2):  # the stream moves to the second, then loses it too
            wait_until(lambda worker=worker: decoding_on(worker) == 1, timeout=30,
                       what="the stream decoding", interval=0.02)
            worker.kill(signal.SIGKILL)
        result = future.result(timeout=60)
    assert result.status == 200 and result.texts[0]
    assert result.finish == {0: "error"} and len(result.errors) == 1, result
    assert deployment.metric("splitserve_gateway_migrations_total") >= 1
    assert deployment.metric("splitserve_gateway_migration_failures_total") == 1
    # Nothing hangs or leaks: the prefill worker's blocks are back, the gateway answers.
    assert p1.health().stats.kv_blocks_free == free_before
    after = httpx.post(f"{deployment.url}/v1/completions", timeout=30, json={
        "model": long_model.name, "prompt": [5, 6, 7], "max_tokens": 4})
    assert after.status_code == 503


def test_a_stream_waits_for_its_killed_decoder_to_restart_rather_than_spend_its_moves(
        deployment, long_model):
    """One move allowed, one decoder left: kill -9 of it mid-stream and a restart on its port.
    The move waits for a Health poll to find it serving again; before, the dead worker still
    looked available (its breaker closed), the move was tried on it at once, refused, and the
    stream ended in an error 30 ms after the kill (a migration audit)."""
    deployment.start("--migration-limit", "1", "--migration-wait-s", "60")
    d1, d2 = deployment.workers["d1"], deployment.workers["d2"]
    d2.kill(signal.SIGKILL)
    wait_until(lambda: "unreachable" in deployment.gateway.output(), timeout=30,
               what="the gateway to see d2 gone", interval=0.05)
    started = threading.Event()
    body = {**request_body(0, long_model.name), "max_tokens": 1500}
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(stream, deployment.url, body, started)
        assert started.wait(60)
        kill_when_decoding(d1, streams=1)
        deployment.workers["d1"] = start_worker("decode", long_model, *FLAGS, port=d1.port)
        result = future.result(timeout=120)
    assert result.status == 200 and not result.errors, result
    assert result.finish == {0: "length"} and result.usage["completion_tokens"] == 1500
    assert deployment.metric("splitserve_gateway_migrations_total") == 1


def stop_at(text: str, stop: str) -> str:
    """The text a `stop` string cuts `text` to (the stop string itself is not sent)."""
    return text[:text.index(stop)]


def test_kill_9_with_speculation_and_stop_strings_continues_both(deployment, long_model):
    """Speculative decoding on both decoders (the model as its own draft, so that proposals
    are accepted and the batch gate keeps speculating), and a stop string per request that the
    undisturbed text reaches late: after a kill -9 mid-stream the moved streams are still
    stop where the undisturbed text has its stop string, the survivor keeps speculating, and
    the texts are otherwise
    unchanged. The undisturbed texts come from this deployment before the kill. Greedy
    requests: a draft model's sampled proposals go through the rejection rule, so a seeded
    request's text depends on what was proposed, on an undisturbed run too (README,
    Speculative decoding)."""
    deployment.start(decode_flags=("--speculative-method", "draft",
                                   "--draft-model", str(long_model)))
    bodies = [{**request_body(i, long_model.name), "max_tokens": 400} for i in (0, 2, 4, 6, 8, 10)]
    free = [r.texts[0] for r in run_all(deployment.url, bodies)]
    stops = [text[int(len(text) * 0.8):][:4] for text in free]
    expected = [stop_at(text, stop) for text, stop in zip(free, stops, strict=True)]
    d1 = deployment.workers["d1"]
    d2 = deployment.workers["d2"]
    accepted_before = spec_accepted(d2)

    stopped = [{**body, "stop": [stop]} for body, stop in zip(bodies, stops, strict=True)]
    # Watched from the start: speculating, d1's streams can be done by the time the last of
    # the six has its first token (a clean-clone CI run waited 30 s for two that had ended).
    with ThreadPoolExecutor(1) as pool:
        killed = pool.submit(kill_when_decoding, d1)
        results = stream_all(deployment.url, stopped, finish="stop")
        killed.result()
    assert [r.texts[0] for r in results] == expected
    assert deployment.metric("splitserve_gateway_migrations_total") >= 2
    assert spec_accepted(d2) > accepted_before, "the survivor did not speculate"


def spec_accepted(worker) -> float:
    """Speculative tokens a decode worker has accepted."""
    text = httpx.get(f"http://{worker.metrics_address}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("splitserve_spec_accepted_tokens"))


def test_kill_9_mid_stream_keeps_each_constrained_stream_under_its_grammar(deployment,
                                                                           long_model):
    """Regex-constrained streams (the grammar state is rebuilt on the new decoder from the
    tokens the client already has): after a kill -9 mid-stream each text matches its regex
    whole and equals the text undisturbed on this deployment before the kill."""
    deployment.start()
    regex = "([0-9]{3}-[a-z]{2,4} ){30}"
    bodies = [{**request_body(i, long_model.name), "max_tokens": 1000, "ignore_eos": False,
               "structured_outputs": {"regex": regex}} for i in range(6)]
    undisturbed = [r.texts for r in stream_all(deployment.url, bodies, finish="stop")]
    d1 = deployment.workers["d1"]

    results = stream_all(deployment.url, bodies, lambda: kill_when_decoding(d1), finish="stop")
    for result, texts in zip(results, undisturbed, strict=True):
        assert all(re.fullmatch(regex, text) for text in result.texts.values()), result
        assert result.texts == texts
    assert deployment.metric("splitserve_gateway_migrations_total") >= 2
