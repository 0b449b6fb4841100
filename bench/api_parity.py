"""Does a vLLM client work unchanged against splitserve? The same requests, sent to vLLM's CPU
build and to splitserve (each with its shipped settings, started here one after the other), and
the answers compared by shape: status class, the JSON keys at every depth, and for streams the
keys of the events. Values are not compared (sampling, ids and timestamps differ), except the
greedy text, which is shown.

    python -m bench.api_parity                       # vLLM (make peers) against splitserve-disagg
    python -m bench.api_parity --systems splitserve-agg --out bench/results/DATE-api-parity

A key only vLLM returns is what a vLLM client could miss; one only splitserve returns is an
extension (usage.splitserve, ...). Prints a table; --out writes report.json and report.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.compare.__main__ import shipped_dtype
from bench.compare.systems import (
    SYSTEMS,
    RunningSystem,
    ServeOptions,
    serve_settings,
    start_system,
)

REPO = Path(__file__).resolve().parents[1]
MODEL = "placeholder"  # replaced by each system's served name

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
HI = [{"role": "user", "content": "What is the capital of France?"}]


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: dict
    method: str = "POST"

    @property
    def streams(self) -> bool:
        return bool(self.body.get("stream"))


def cases() -> list[Case]:
    chat, comp = "/v1/chat/completions", "/v1/completions"
    greedy = {"temperature": 0, "max_tokens": 8}
    return [
        Case("models", "/v1/models", {}, method="GET"),
        Case("chat", chat, {"messages": HI, **greedy}),
        Case("chat stream + usage", chat, {"messages": HI, **greedy, "stream": True,
                                           "stream_options": {"include_usage": True}}),
        Case("chat logprobs top 2", chat, {"messages": HI, **greedy, "logprobs": True,
                                           "top_logprobs": 2}),
        Case("chat n=2", chat, {"messages": HI, "max_tokens": 4, "n": 2, "seed": 1}),
        Case("chat json_schema", chat, {"messages": HI, **greedy, "max_tokens": 30,
                                        "response_format": {"type": "json_schema", "json_schema": {
                                            "name": "a", "schema": {
                                                "type": "object",
                                                "properties": {"city": {"type": "string"}},
                                                "required": ["city"]}}}}),
        Case("chat tool required", chat, {"messages": [{"role": "user",
                                                        "content": "Weather in Paris?"}],
                                          "tools": [WEATHER_TOOL], "tool_choice": "required",
                                          "temperature": 0, "max_tokens": 40}),
        Case("chat prompt_logprobs", chat, {"messages": HI, **greedy, "prompt_logprobs": 1}),
        Case("chat return_token_ids", chat, {"messages": HI, **greedy,
                                             "return_token_ids": True}),
        Case("completion", comp, {"prompt": "The capital of France is", **greedy}),
        Case("completion stream", comp, {"prompt": "The capital of France is", **greedy,
                                         "stream": True}),
        Case("completion echo logprobs", comp, {"prompt": "The capital of France is",
                                                **greedy, "echo": True, "logprobs": 1}),
        Case("completion logprobs 0", comp, {"prompt": "The capital of France is", **greedy,
                                             "logprobs": 0}),
        Case("completion token ids", comp, {"prompt": [504, 3575, 282, 4649], **greedy}),
        Case("completion stop", comp, {"prompt": "1, 2, 3,", "stop": [" 5"], **greedy,
                                       "max_tokens": 20}),
        Case("tokenize", "/tokenize", {"prompt": "hello world"}),
        Case("detokenize", "/detokenize", {"tokens": [28120, 905]}),
        # Errors: the status and the error body's shape.
        Case("error: negative max_tokens", comp, {"prompt": "hi", "max_tokens": -5}),
        Case("error: unknown model", chat, {"messages": HI, "model": "no-such-model"}),
        Case("error: prompt too long", comp, {"prompt": "hi " * 9000, "max_tokens": 4}),
        Case("error: bad json", chat, {"__raw__": '{"model": '}),
        Case("error: image part", chat, {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}],
            "max_tokens": 4}),
    ]


def shape(value, path: str = "") -> set[str]:
    """The key paths of a JSON value: a dict's keys under `path`, a list's items as `path[]`
    (the union of its items' shapes). Values are left out, and so are keys whose value is null
    (vLLM writes every optional field; a client reads null and absent alike)."""
    out: set[str] = set()
    if isinstance(value, dict):
        for key, item in value.items():
            if item is None:
                continue
            # Keys that are data (token ids of prompt_logprobs' entries, logit maps) vary.
            name = "<id>" if key.isdigit() else key
            out.add(f"{path}.{name}")
            out |= shape(item, f"{path}.{name}")
    elif isinstance(value, list):
        for item in value:
            out |= shape(item, f"{path}[]")
    return out


def sse_shapes(text: str) -> tuple[set[str], list[dict]]:
    """The shape of every `data:` event of a stream (the union), and the events."""
    events = []
    for line in text.splitlines():
        if line.startswith("data: ") and line[6:].strip() != "[DONE]":
            try:
                events.append(json.loads(line[6:]))
            except json.JSONDecodeError:
                events.append({"<not json>": line[6:80]})
    out: set[str] = set()
    for event in events:
        out |= shape(event)
    return out, events


@dataclass
class Answer:
    status: int
    keys: set[str] = field(default_factory=set)
    text: str = ""
    error: str = ""  # the error message of a 4xx/5xx


def _text(body: dict | list[dict]) -> str:
    """The greedy text of a chat or completion answer (streams: joined)."""
    events = body if isinstance(body, list) else [body]
    parts = []
    for event in events:
        for choice in event.get("choices", []) if isinstance(event, dict) else []:
            if choice.get("index", 0) != 0:
                continue
            message = choice.get("message") or choice.get("delta") or {}
            parts.append(choice.get("text") or message.get("content") or "")
    return "".join(parts)


def ask(client: httpx.Client, url: str, model: str, case: Case) -> Answer:
    if case.method == "GET":
        response = client.get(url + case.path)
        return Answer(response.status_code, shape(response.json()))
    if "__raw__" in case.body:
        response = client.post(url + case.path, content=case.body["__raw__"],
                               headers={"content-type": "application/json"})
    else:
        response = client.post(url + case.path, json={"model": model, **case.body})
    try:
        if case.streams and response.status_code == 200:
            keys, events = sse_shapes(response.text)
            return Answer(response.status_code, keys, _text(events))
        body = response.json()
    except ValueError:
        return Answer(response.status_code, {"<not json>"})
    error = body.get("error") if isinstance(body, dict) else None
    message = str(error.get("message", "")) if isinstance(error, dict) else ""
    return Answer(response.status_code, shape(body), _text(body), message[:300])


def serve_and_ask(name: str, model_dir: str, log_dir: Path, opts: ServeOptions,
                  commands: dict[str, str]) -> dict[str, Answer]:
    print(f"starting {name} ...", flush=True)
    started = time.monotonic()
    system: RunningSystem = start_system(SYSTEMS[name], model_dir, log_dir, opts)
    commands[name] = " ".join(system.command)  # environment overrides first
    print(f"  ready in {time.monotonic() - started:.0f} s: {commands[name]}", flush=True)
    answers = {}
    try:
        with httpx.Client(timeout=120) as client:
            for case in cases():
                answers[case.name] = ask(client, system.url, system.model_name, case)
                print(f"  {case.name}: {answers[case.name].status}", flush=True)
    finally:
        system.stop()
    return answers


def compare(peer: dict[str, Answer], ours: dict[str, Answer]) -> list[dict]:
    rows = []
    for case in cases():
        theirs, mine = peer[case.name], ours[case.name]
        rows.append({
            "case": case.name,
            "status": [theirs.status, mine.status],
            "same_status_class": theirs.status // 100 == mine.status // 100,
            "only_peer": sorted(theirs.keys - mine.keys),
            "only_ours": sorted(mine.keys - theirs.keys),
            "text": [theirs.text, mine.text],
            "error": [theirs.error, mine.error],
        })
    return rows


def markdown(rows: list[dict], peer: str, ours: str) -> str:
    lines = [f"| case | status {peer} / {ours} | keys only {peer} has | keys only {ours} has |",
             "|---|---|---|---|"]
    for row in rows:
        mark = "" if row["same_status_class"] else " (differs)"
        lines.append(f"| {row['case']} | {row['status'][0]} / {row['status'][1]}{mark} | "
                     f"{', '.join(row['only_peer']) or '-'} | {', '.join(row['only_ours']) or '-'} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(REPO / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--systems", default="splitserve-disagg",
                        help="splitserve deployments to hold against vLLM, comma-separated")
    parser.add_argument("--out", default="", help="a folder for report.json and report.md")
    args = parser.parse_args()
    log_dir = Path(args.out or "/tmp/splitserve-api-parity") / "logs"
    if not SYSTEMS["vllm"].installed():
        print("vLLM is not installed here: `make peers` installs it", file=sys.stderr)
        return 2
    systems = args.systems.split(",")
    # What each side runs with: splitserve as shipped (the overrides line says "none"), vLLM in
    # the best configuration found for it here.
    # splitserve's dtype "auto"; the peer the dtype that resolves to here, as bench.compare runs it.
    opts = ServeOptions(peer_dtype=shipped_dtype())
    settings = dataclasses.replace(serve_settings(opts, ("vllm", *systems)),
                                   bench="bench.api_parity").text()
    print(settings, flush=True)
    commands: dict[str, str] = {}
    peer = serve_and_ask("vllm", args.model, log_dir, opts, commands)
    report: dict = {"settings": settings, "commands": commands}
    for name in systems:
        rows = compare(peer, serve_and_ask(name, args.model, log_dir, opts, commands))
        report[name] = rows
        print(f"\nvLLM against {name}:\n" + markdown(rows, "vLLM", name))
        for row in rows:
            if not row["same_status_class"]:
                print(f"  status differs, {row['case']}: {row['error'][0] or '(no error)'!r} / "
                      f"{row['error'][1] or '(no error)'!r}")
            if row["text"][0] != row["text"][1] and row["text"][0]:
                print(f"  greedy text differs, {row['case']}: {row['text'][0]!r} / "
                      f"{row['text'][1]!r}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(report, indent=1))
        (out / "report.md").write_text(
            "Settings:\n\n" + settings + "\n\nCommands:\n\n"
            + "".join(f"- {name}: `{command}`\n" for name, command in commands.items())
            + "".join(f"\n## vLLM against {name}\n\n" + markdown(report[name], "vLLM", name)
                      for name in systems))
    return 0


if __name__ == "__main__":
    sys.exit(main())
