"""What tool calling costs the gateway per request: parsing, the tools' checks and grammar
compile, the chat template and tokenizing, for a chat request without tools (the baseline, same
run) and with two tools under each tool_choice; and the output parser's time per character.
The gateway's defaults (GatewayConfig, --tool-call-parser hermes), SmolLM2's tokenizer:

    .venv/bin/python bench/tool_calling.py
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from services.gateway.api.preprocess import ModelLimits, Preprocessor
from services.gateway.api.protocol import ChatCompletionRequest, parse_body
from services.gateway.api.request_limits import RequestLimits
from services.gateway.api.tokenizer import ModelTokenizer
from services.gateway.api.tool_output import tool_message
from services.gateway.api.tool_parsers import tool_format
from services.gateway.api.tools import tool_plan
from services.gateway.config import GatewayConfig

MODEL = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct"
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "required": ["city", "unit"], "properties": {
            "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "required": ["a", "b"], "properties": {
            "a": {"type": "integer"}, "b": {"type": "integer"}}}}},
]
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris today?"}]
CASES = {"no tools (baseline)": {}, "tools, auto": {"tools": TOOLS},
         "tools, required": {"tools": TOOLS, "tool_choice": "required"},
         "tools, named": {"tools": TOOLS,
                          "tool_choice": {"type": "function", "function": {"name": "add"}}}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()
    config = GatewayConfig(model=str(MODEL), worker=("127.0.0.1:1",))
    preprocessor = Preprocessor(ModelTokenizer(MODEL), RequestLimits.from_config(config),
                                tool_format(config.tool_call_parser))
    limits = ModelLimits(vocab_size=49152, max_model_len=8192)
    bodies = {name: json.dumps({"model": "m", "messages": MESSAGES, **extra}).encode()
              for name, extra in CASES.items()}

    def preprocess(body: bytes) -> None:
        preprocessor.chat_with_tools("bench", parse_body(ChatCompletionRequest, body), limits)

    # Builds llguidance's view of the tokenizer (once per process), with other tools.
    preprocess(json.dumps({"model": "m", "messages": MESSAGES, "tools": TOOLS[:1]}).encode())
    print(f"gateway preprocessing per chat request ({args.requests} requests each)")
    baseline = None
    for name, body in bodies.items():
        start = time.perf_counter()
        first = _timed(preprocess, body)  # a new tool set: its grammar is compiled
        for _ in range(args.requests):
            preprocess(body)
        per_request = (time.perf_counter() - start - first) / args.requests
        baseline = baseline or per_request
        print(f"  {name:20s} {per_request * 1e3:6.2f} ms ({per_request / baseline:4.1f}x the "
              f"baseline); first request {first * 1e3:6.2f} ms")

    plan = tool_plan(TOOLS, "auto", tool_format("hermes"))
    text = ("Let me check that for you. " * 8 + '<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>')
    start = time.perf_counter()
    for _ in range(args.requests):
        tool_message(plan, text)
    per_char = (time.perf_counter() - start) / args.requests / len(text)
    print(f"output parser (hermes, whole message): {per_char * 1e9:.0f} ns per character")


def _timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
