"""Benchmark: speculative decoding on SmolLM2 — decode tokens/s and acceptance rate with and
without speculation, at batch 1 and batch 16, on a copy-heavy workload (rewrite or fix a given
text, edit given code) and on open chat.

Run from the repo root:
  .venv/bin/python bench/specdec.py --workloads copy --draft-layers 8   (and --workloads chat)
Greedy decoding, EOS honoured (each request stops where the model does, the same with and
without speculation). The modes' engines run the same requests in lockstep, one step each in
turn, so drift in the machine's load hits them alike; only decode steps are timed. Results go
to stdout and bench/results/specdec/<workloads>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(_ROOT))
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.spec_decode.config import SpeculativeConfig  # noqa: E402

# -- workloads --------------------------------------------------------------------------------

TEXTS = [
    "Our team moved the weekly planning meeting from Monday to Tuesday morning, because "
    "half of the engineers were travelling on Mondays. The meeting now starts at nine "
    "o'clock in the small room near the kitchen, and it should never take more than one "
    "hour. Please bring a short list of what you finished last week and what you plan to "
    "do next, so that we can spend the time on the problems and not on the status.",
    "The old library near the station opens again next month after two years of repairs. "
    "The roof was replaced, the reading room has new lights and new chairs, and the "
    "children's corner moved to the first floor, next to the garden. The library will be "
    "open every day from ten in the morning to eight in the evening, and on Sundays from "
    "noon to five. Members can borrow up to ten books at a time for three weeks.",
    "To set up the development machine, first install Python 3.11 and git. Then clone the "
    "repository, create a virtual environment in the project folder, and install the "
    "package with its test dependencies. Run the unit tests once to check that everything "
    "works. If a test fails because a model file is missing, run the command that "
    "downloads the small test models, and then run the tests again.",
    "Every morning the river fog covers the valley until the sun climbs over the eastern "
    "hills. The farmers wait for it to lift before they take the cows to the high meadows, "
    "where the grass is still green in late summer. In the evening they come back down the "
    "narrow road, past the mill and the old stone bridge, and the bells of the cows can be "
    "heard from the village long before anyone sees them.",
]
TEXT_TASKS = [
    "Rewrite the following text, fixing any mistakes but keeping every sentence:\n\n{}",
    "Copy the following text exactly, then add one sentence at the end:\n\n{}",
]
CODE = [
    '''def hash_prompt_blocks(token_ids, block_size):
    hashes = []
    parent = ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, tuple(token_ids[start : start + block_size]))
        hashes.append(parent)
    return hashes''',
    '''def free(self, blocks):
    for block in blocks:
        if block.ref_cnt <= 0:
            raise RuntimeError(f"double free of block {block.block_id}")
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            self._free[block.block_id] = None''',
    '''def parse_size(text):
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"cannot read {text!r} as a size")
    unit = (match.group(2) or "").upper().removesuffix("B")
    return int(float(match.group(1)) * _UNITS[unit])''',
    '''def cdiv(a, b):
    return -(-a // b)


def blocks_needed(num_tokens, block_size):
    if num_tokens <= 0:
        return 0
    return cdiv(num_tokens, block_size)''',
]
CODE_TASKS = [
    "Rename the variable `block_size` to `size` wherever it appears in this Python code "
    "(if it does not appear, rename the first argument to `items`), and show the whole "
    "function:\n\n```python\n{}\n```",
    "Add type hints to this Python function and show the whole function:\n\n"
    "```python\n{}\n```",
]
CHAT = [
    "What are three good habits for staying healthy while working from home?",
    "Write a short story about a robot who learns to paint.",
    "Why do leaves change colour in autumn?",
    "Give me some ideas for a birthday party for a ten-year-old.",
    "How does a bicycle stay upright when it is moving?",
    "What should I pack for a weekend hiking trip in the mountains?",
    "Explain what a database index is to a beginner.",
    "What are the pros and cons of living in a big city?",
    "Describe a perfect lazy Sunday.",
    "How can I get better at remembering people's names?",
    "What is the difference between weather and climate?",
    "Suggest a plan for learning to cook in one month.",
    "Why is the sky blue?",
    "Tell me about the history of the bicycle in a few paragraphs.",
    "How do I start running if I have never exercised?",
    "What makes a good team leader?",
]


def copy_heavy_prompts() -> list[str]:
    prompts = [task.format(text) for text in TEXTS for task in TEXT_TASKS]
    prompts += [task.format(code) for code in CODE for task in CODE_TASKS]
    return prompts  # 16


WORKLOADS = {"copy": copy_heavy_prompts, "chat": lambda: list(CHAT)}


# -- running ----------------------------------------------------------------------------------


@dataclass
class Measure:
    """Decode-phase totals of one mode on one (workload, batch) cell."""

    tokens: int = 0  # output tokens after each request's first (the decode phase)
    seconds: float = 0.0
    proposed: int = 0
    accepted: int = 0
    verifications: int = 0
    steps: int = 0  # timed decode steps
    gated: int = 0  # of which the batch gate kept plain
    outputs: dict[str, list[int]] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None


def build_layer_draft(target: str, num_layers: int, out: Path) -> Path:
    """A draft for `target` made of its first `num_layers` layers, its final norm and its
    (tied) head: the same tokenizer by construction, no download. The only SmolLM2 on this
    machine is the target itself, and this is the cheapest draft that shares its vocabulary."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if (out / "model.safetensors").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    kept = {}
    with safe_open(str(Path(target) / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            parts = name.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= num_layers:
                continue
            kept[name] = f.get_tensor(name)
    config = json.loads((Path(target) / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for file in Path(target).glob("*"):
        if file.name.startswith("tokenizer") or file.name == "generation_config.json":
            (out / file.name).write_bytes(file.read_bytes())
    save_file(kept, str(out / "model.safetensors"))
    return out


def build_engine(args, spec: SpeculativeConfig | None) -> LLMEngine:
    config = EngineConfig(
        model=args.model, dtype=args.dtype, num_threads=args.threads, seed=0,
        max_model_len=2048, speculative=spec or SpeculativeConfig(),
    )
    return LLMEngine(config)


class Run:
    """One mode's batch of requests on its engine, stepped one step at a time."""

    def __init__(self, engine: LLMEngine, prompts: list[list[int]], names: list[str],
                 max_tokens: int) -> None:
        self.engine = engine
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        tag = time.monotonic_ns()
        self.names = {f"{tag}-{i}": name for i, name in enumerate(names)}
        for rid, prompt in zip(self.names, prompts, strict=True):
            engine.add_request(rid, prompt, params)
        self.tokens: dict[str, list[int]] = {rid: [] for rid in self.names}
        self.seconds = 0.0
        self.steps = 0
        self.before: dict[str, float] = {}

    def prefill(self) -> None:
        """Untimed: speculation only changes the decode phase."""
        while any(not t for t in self.tokens.values()):
            self._absorb(self.engine.step())
        self.before = self.engine.stats()

    def step(self) -> bool:
        """One timed step; False once every request has finished."""
        if not self.engine.has_unfinished():
            return False
        start = time.perf_counter()
        outputs = self.engine.step()
        self.seconds += time.perf_counter() - start
        self.steps += 1
        self._absorb(outputs)
        return True

    def _absorb(self, outputs) -> None:
        for out in outputs:
            self.tokens[out.request_id].extend(out.new_token_ids)

    def add_to(self, measure: Measure) -> None:
        after = self.engine.stats()
        measure.seconds += self.seconds
        measure.steps += self.steps
        measure.tokens += sum(len(t) - 1 for t in self.tokens.values())
        for key, attr in (("spec_proposed_tokens", "proposed"),
                          ("spec_accepted_tokens", "accepted"),
                          ("spec_verifications", "verifications"),
                          ("spec_gated_steps", "gated")):
            if key in after:
                setattr(measure, attr, getattr(measure, attr) + after[key] - self.before[key])
        for rid, name in self.names.items():
            measure.outputs[name] = self.tokens[rid]


def run_cell(engines: dict[str, LLMEngine], prompts: list[list[int]], batch: int,
             max_tokens: int) -> dict[str, Measure]:
    """Every mode runs the same groups of `batch` prompts in lockstep, one step of each in
    turn, so changes in the machine's load hit every mode alike."""
    measures = {mode: Measure() for mode in engines}
    names = [f"q{i}" for i in range(len(prompts))]
    for first in range(0, len(prompts), batch):
        group = slice(first, first + batch)
        runs = {mode: Run(engine, prompts[group], names[group], max_tokens)
                for mode, engine in engines.items()}
        for run in runs.values():
            run.prefill()
        active = list(runs.values())
        while active:
            active = [run for run in active if run.step()]
        for mode, run in runs.items():
            run.add_to(measures[mode])
        print(f"    {min(first + batch, len(prompts))}/{len(prompts)} prompts: " + ", ".join(
            f"{m} {x.tokens_per_s:.1f} tok/s" for m, x in measures.items()), flush=True)
    return measures


def encode(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                        add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    return list(ids)


def plot(results_dir: Path) -> Path:
    """One bar per (workload, batch, mode) of every results JSON in `results_dir`: speedup
    over the plain engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for f in sorted(results_dir.glob("*.json")) if "quick" not in f.name
            for r in json.loads(f.read_text())["rows"] if r["mode"] != "off"]
    cells = sorted({(r["workload"], r["batch"]) for r in rows}, key=lambda c: (c[0] != "copy", c))
    modes = sorted({r["mode"] for r in rows})
    fig, ax = plt.subplots(figsize=(8, 3.5))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        speed = {(r["workload"], r["batch"]): r["speedup"] for r in rows if r["mode"] == mode}
        ax.bar([c + i * width for c in range(len(cells))], [speed.get(c, 0) for c in cells],
               width, label=mode)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cells))],
                  [f"{w}, batch {b}" for w, b in cells])
    ax.set_ylabel("decode tokens/s vs plain")
    ax.set_title("Speculative decoding on SmolLM2-135M (CPU, 1 thread)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = results_dir / "speedup.png"
    fig.savefig(out, dpi=120)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(_ROOT / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--draft-model", default="", help="also measure this draft model")
    parser.add_argument("--draft-layers", type=int, default=0,
                        help="also measure a draft made of the target's first N layers "
                             "(built under /tmp on first use)")
    parser.add_argument("--dtype", default="auto")
    # One thread: on a shared two-core machine a second intra-op thread makes steps slower
    # and far noisier (a SmolLM2 decode step went from ~90 ms to 130-820 ms).
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--workloads", default="copy,chat")
    parser.add_argument("--batch1-prompts", type=int, default=8,
                        help="prompts per workload at batch 1 (each runs alone)")
    parser.add_argument("--quick", action="store_true", help="fewer prompts and tokens")
    parser.add_argument("--out", default="",
                        help="results JSON (default bench/results/specdec/<workloads>.json)")
    parser.add_argument("--plot", action="store_true",
                        help="only plot the results JSONs in bench/results/specdec/")
    args = parser.parse_args()
    if args.plot:
        print(f"plot written to {plot(_ROOT / 'bench' / 'results' / 'specdec')}")
        return 0
    if args.quick:
        args.max_tokens, args.batch1_prompts = 64, 3
    if not args.out:
        name = args.workloads.replace(",", "-") + ("-quick" if args.quick else "")
        args.out = str(_ROOT / "bench" / "results" / "specdec" / f"{name}.json")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    modes: dict[str, SpeculativeConfig | None] = {
        "off": None,
        # The shipped policy: adaptive k, speculation only where it measures faster.
        "ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=args.k),
        # Always on, every batch size: shows where speculation stops paying.
        "ngram-forced": SpeculativeConfig(method="ngram", num_speculative_tokens=args.k,
                                          adaptive_batch=False),
    }
    if args.draft_layers and not args.draft_model:
        draft_dir = Path("/tmp") / f"splitserve-draft-{Path(args.model).name}-{args.draft_layers}l"
        args.draft_model = str(build_layer_draft(args.model, args.draft_layers, draft_dir))
    if args.draft_model:
        modes["draft"] = SpeculativeConfig(method="draft", num_speculative_tokens=args.k,
                                           draft_model=args.draft_model)
    print(f"loading {len(modes)} engines ({args.model}, {args.threads} threads)", flush=True)
    engines = {mode: build_engine(args, spec) for mode, spec in modes.items()}
    dtype = str(engines["off"].runner.dtype).removeprefix("torch.")
    rows = []
    for workload in args.workloads.split(","):
        texts = WORKLOADS[workload]()
        prompts = [encode(tokenizer, t) for t in texts]
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            cell_prompts = prompts[: args.batch1_prompts] if batch == 1 else prompts[:batch]
            print(f"{workload}, batch {batch}: {len(cell_prompts)} prompts", flush=True)
            measures = run_cell(engines, cell_prompts, batch, args.max_tokens)
            base = measures["off"]
            for mode, m in measures.items():
                same = sum(m.outputs[n] == base.outputs[n] for n in base.outputs)
                rows.append({
                    "workload": workload, "batch": batch, "mode": mode,
                    "tokens_per_s": round(m.tokens_per_s, 2),
                    "speedup": round(m.tokens_per_s / base.tokens_per_s, 3),
                    "acceptance": None if m.acceptance is None else round(m.acceptance, 3),
                    "tokens_per_verification": (round((m.accepted + m.verifications)
                                                      / m.verifications, 2)
                                                if m.verifications else None),
                    "decode_tokens": m.tokens, "seconds": round(m.seconds, 2),
                    "outputs_identical": f"{same}/{len(base.outputs)}",
                    "gated_steps": (round(m.gated / m.steps, 3)
                                    if mode != "off" and m.steps else None),
                })
    print()
    header = (f"{'workload':8} {'batch':>5} {'mode':13} {'tok/s':>8} {'speedup':>8} "
              f"{'accept':>7} {'tok/verif':>9} {'same out':>9} {'gated':>6}")
    print(header)
    print("-" * len(header))
    for r in rows:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
        tpv = "-" if r["tokens_per_verification"] is None else f"{r['tokens_per_verification']:.2f}"
        print(f"{r['workload']:8} {r['batch']:>5} {r['mode']:13} {r['tokens_per_s']:>8.1f} "
              f"{r['speedup']:>7.2f}x {acc:>7} {tpv:>9} {r['outputs_identical']:>9} "
              f"{'-' if r['gated_steps'] is None else format(r['gated_steps'], '.0%'):>6}")
    gate = engines["ngram"].speculator.gate.snapshot()
    print(f"\nmeasured speedup of speculating, per batch range, as the adaptive ngram engine's "
          f"gate saw it: {gate}")
    result = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": os.cpu_count(), "threads": args.threads, "dtype": dtype,
                    "torch": torch.__version__},
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "rows": rows, "gate": gate,
        "modes": {m: asdict(s) if s else None for m, s in modes.items()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"results written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
