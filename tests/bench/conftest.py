"""A tiny real OpenAI-style SSE server (FastAPI + uvicorn on a free port, in a thread) whose pacing
the tests control, so the load generator's timing and parsing can be checked against known
values."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


@dataclass
class FakeBehaviour:
    ttft_s: float = 0.1  # before the first token
    itl_s: float = 0.02  # between tokens
    send_done: bool = True  # end with `data: [DONE]` (transformers serve does not)
    reject_ignore_eos: bool = False  # answer 422 to ignore_eos, as transformers serve does
    api_keys: tuple[str, ...] = ()  # when set, a missing or unknown Bearer key is a 401


@dataclass
class FakeServer:
    url: str
    behaviour: FakeBehaviour
    bodies: list[dict] = field(default_factory=list)
    headers: list[dict] = field(default_factory=list)
    in_flight: int = 0
    peak_in_flight: int = 0

    def reset(self, **behaviour) -> None:
        self.behaviour = FakeBehaviour(**behaviour)
        self.bodies.clear()
        self.headers.clear()
        self.peak_in_flight = 0


def _chunk(endpoint: str, text: str, finish: str | None = None) -> str:
    choice = ({"index": 0, "delta": {"content": text}, "finish_reason": finish}
              if endpoint == "chat" else {"index": 0, "text": text, "finish_reason": finish})
    return "data: " + json.dumps({"choices": [choice]}) + "\n\n"


def _app(server: FakeServer) -> FastAPI:
    app = FastAPI()

    async def handle(request: Request, endpoint: str):
        body = await request.json()
        server.bodies.append(body)
        server.headers.append(dict(request.headers))
        b = server.behaviour
        if b.api_keys and request.headers.get("authorization", "")[7:] not in b.api_keys:
            return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
        if b.reject_ignore_eos and "ignore_eos" in body:
            return JSONResponse({"detail": "Unexpected fields: ignore_eos"}, status_code=422)
        prompt = body.get("prompt") or body["messages"][0]["content"]
        if prompt in ("reject429", "reject503"):
            return JSONResponse({"error": {"message": "busy"}}, status_code=int(prompt[-3:]),
                                headers={"Retry-After": "1"})
        n = body["max_tokens"]

        async def stream():
            server.in_flight += 1
            server.peak_in_flight = max(server.peak_in_flight, server.in_flight)
            try:
                yield ": a comment line, which clients must skip\n\n"
                await asyncio.sleep(b.ttft_s)
                for i in range(n):
                    if i:
                        await asyncio.sleep(b.itl_s)
                    if prompt == "break" and i == 2:
                        yield 'data: {"error": {"message": "worker died"}}\n\n'
                        return
                    yield _chunk(endpoint, f" t{i}", "length" if i == n - 1 else None)
                usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
                yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
                if b.send_done:
                    yield "data: [DONE]\n\n"
            finally:
                server.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, "chat")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    return app


@pytest.fixture(scope="module")
def fake_server():
    # Port 0: the server binds a free port itself (one picked here could be taken meanwhile).
    server = FakeServer("", FakeBehaviour())
    uv = uvicorn.Server(uvicorn.Config(_app(server), host="127.0.0.1", port=0,
                                       log_level="warning", lifespan="off"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not uv.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the fake SSE server did not start")
        time.sleep(0.02)
    port = uv.servers[0].sockets[0].getsockname()[1]
    server.url = f"http://127.0.0.1:{port}"
    yield server
    uv.should_exit = True
    thread.join(10)


@pytest.fixture
def server(fake_server: FakeServer) -> FakeServer:
    """The module's fake server with default behaviour and empty logs."""
    fake_server.reset()
    return fake_server
