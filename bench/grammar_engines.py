"""Grammar engines for constrained decoding, measured on SmolLM2's vocabulary: the compile time
of a typical JSON schema and the time to compute one token's mask while walking a valid answer.
Runs with whichever of llguidance / xgrammar the interpreter has (the project venv has
llguidance; bench/.peers/vllm has both):

    .venv/bin/python bench/grammar_engines.py
    bench/.peers/vllm/bin/python bench/grammar_engines.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

MODEL = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct"

# Nested objects, an enum, an array and bounded numbers: what chat.completions.parse sends.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"], "additionalProperties": False,
        },
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "role", "tags", "address", "score"],
    "additionalProperties": False,
}
ANSWER = json.dumps({"name": "Ada Lovelace", "age": 36, "role": "admin",
                     "tags": ["math", "engines", "poetry"],
                     "address": {"city": "London", "zip": "W1"}, "score": 0.97})


def _tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(MODEL)


def measure_llguidance(hf, tokens: list[int], repeats: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch
    start = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf)
    tokenizer_s = time.perf_counter() - start
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    compile_s, mask_s = [], []
    mask = llguidance.torch.allocate_token_bitmask(1, tok.vocab_size)
    for _ in range(repeats):
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(tok, grammar)
        compile_s.append(time.perf_counter() - start)
        assert not matcher.is_error(), matcher.get_error()
        for t in tokens:
            start = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(matcher, mask)
            mask_s.append(time.perf_counter() - start)
            assert matcher.consume_token(t), matcher.get_error()
    return {"engine": f"llguidance {llguidance.__version__}", "tokenizer_s": tokenizer_s,
            "compile_ms": 1e3 * statistics.median(compile_s),
            "mask_us_mean": 1e6 * statistics.mean(mask_s),
            "mask_us_median": 1e6 * statistics.median(mask_s),
            "mask_us_p99": 1e6 * sorted(mask_s)[int(0.99 * len(mask_s))]}


def measure_xgrammar(hf, tokens: list[int], repeats: int) -> dict:
    from importlib.metadata import version

    import xgrammar
    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
    tokenizer_s = time.perf_counter() - start
    compile_s, mask_s = [], []
    mask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    for _ in range(repeats):
        # A fresh compiler each time: its cache would hide the compile cost.
        compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
        compile_s.append(time.perf_counter() - start)
        matcher = xgrammar.GrammarMatcher(compiled)
        for t in tokens:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(mask)
            mask_s.append(time.perf_counter() - start)
            assert matcher.accept_token(t)
    return {"engine": f"xgrammar {version('xgrammar')}", "tokenizer_s": tokenizer_s,
            "compile_ms": 1e3 * statistics.median(compile_s),
            "mask_us_mean": 1e6 * statistics.mean(mask_s),
            "mask_us_median": 1e6 * statistics.median(mask_s),
            "mask_us_p99": 1e6 * sorted(mask_s)[int(0.99 * len(mask_s))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    hf = _tokenizer()
    tokens = hf.encode(ANSWER, add_special_tokens=False)
    print(f"vocabulary {len(hf)}, answer {len(tokens)} tokens, {args.repeats} repeats")
    for measure in (measure_llguidance, measure_xgrammar):
        try:
            result = measure(hf, tokens, args.repeats)
        except ImportError as exc:
            print(f"{measure.__name__}: not installed here ({exc.name})")
            continue
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                          for k, v in result.items()}))


if __name__ == "__main__":
    main()
