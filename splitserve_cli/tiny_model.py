"""Build tiny random Llama / Qwen2 checkpoints for tests: real folder layout, seconds to make.

The folder is what a hub checkpoint looks like (config.json, float32 model.safetensors, a byte-level
BPE tokenizer.json with a ChatML template), so engine and service tests exercise the real loading
path without downloading anything.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from pathlib import Path

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]  # ids 0, 1, 2
VOCAB_SIZE = 768
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Standard-deviation of the random weights. The usual 0.02 gives near-uniform logits, so greedy
# decoding collapses onto one token and ties are common; 0.3 gives peaked, context-dependent
# logits (varied greedy text, clear top-1 margins for exact parity checks) without overflow.
INITIALIZER_RANGE = 0.3

COMMON_DIMS = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 8,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "initializer_range": INITIALIZER_RANGE,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}
ARCH_DEFAULTS = {
    "llama": {"tie_word_embeddings": False, "attention_bias": False},
    "qwen2": {"tie_word_embeddings": True},  # Qwen2 always has q/k/v biases
}


def build_tiny_model(out_dir: str | Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Write a tiny random model folder to `out_dir` and return its path.

    `overrides` replace config fields (e.g. `num_hidden_layers=3`). The same (arch, seed,
    overrides) always produce byte-identical weights and tokenizer.
    """
    if arch not in ARCH_DEFAULTS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(ARCH_DEFAULTS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer()
    config = _build_config(arch, tokenizer, overrides)
    model = _build_model(config, seed)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out), save_jinja_files=False)
    _normalize_tokenizer_config(out / "tokenizer_config.json")
    return out


def _build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    # No normalizer: NFC/lowercasing would break the exact byte round trip of arbitrary UTF-8.
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(training_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=COMMON_DIMS["max_position_embeddings"],
    )


def _build_config(arch: str, tokenizer, overrides: dict):
    from transformers import LlamaConfig, Qwen2Config

    fields = {
        **COMMON_DIMS,
        **ARCH_DEFAULTS[arch],
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.convert_tokens_to_ids(ENDOFTEXT),
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "dtype": "float32",
        **overrides,
    }
    config_class, architecture = {
        "llama": (LlamaConfig, "LlamaForCausalLM"),
        "qwen2": (Qwen2Config, "Qwen2ForCausalLM"),
    }[arch]
    return config_class(architectures=[architecture], **fields)


def _build_model(config, seed: int):
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    std = config.initializer_range
    with torch.no_grad():
        # Norm weights and biases are randomized too (transformers sets them to 1 and 0), so a
        # loader that forgets one fails parity instead of passing by luck.
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(std * noise)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    return model.eval()


def _normalize_tokenizer_config(path: Path) -> None:
    fields = json.loads(path.read_text())
    fields["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(fields, indent=2, ensure_ascii=False) + "\n")


def training_corpus() -> list[str]:
    """A few hundred lines of varied English, built deterministically (independent of `seed`)."""
    rng = random.Random(20240601)
    subjects = (
        "The engineer|A small cat|My neighbour|The old library|Our team|The river|"
        "A curious child|The server|This model|The weather|Every student|The garden"
    ).split("|")
    verbs = (
        "reads|writes|watches|builds|finds|carries|remembers|explains|measures|follows|"
        "paints|answers"
    ).split("|")
    objects = (
        "a long letter|the morning news|three red apples|an open window|the quiet road|"
        "a simple question|every request|the blue notebook|two paper boats|the answer|"
        "a map of the city|the first token"
    ).split("|")
    endings = (
        "before breakfast|after the rain|in the evening|with great care|on Tuesday|"
        "near the station|without a sound|for the third time|at noon|as expected"
    ).split("|")
    questions = (
        "What is the capital of France?|How many days are in a week?|Why is the sky blue?|"
        "Can you write a short poem?|Where does the train stop?|Who wrote this letter?|"
        "When will the meeting start?|Which road goes to the sea?"
    ).split("|")
    answers = (
        "The capital of France is Paris.|A week has seven days.|"
        "Sunlight scatters in the air, and blue light scatters the most.|"
        "Soft rain on the hill, the river keeps its song.|It stops at the central station.|"
        "My sister wrote it last summer.|It starts at nine o'clock.|Take the north road."
    ).split("|")
    lines = []
    for subject, verb, obj, ending in itertools.islice(
        itertools.product(subjects, verbs, objects, endings), 0, None, 97
    ):
        lines.append(f"{subject} {verb} {obj} {ending}.")
    for question, answer in zip(questions, answers, strict=True):
        lines.append(f"User: {question}\nAssistant: {answer}")
    for _ in range(120):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        lines.append(f"{rng.choice(subjects)} counted {a} stones and {b} shells, {a + b} in all.")
    for _ in range(60):
        words = rng.sample(objects + endings, 4)
        lines.append(" ".join(words).capitalize() + rng.choice([".", "!", "?", "...", ";"]))
    lines += [
        "def add(a, b):\n    return a + b",
        "for i in range(10): print(i * i)",
        '{"name": "splitserve", "tokens": [1, 2, 3], "ok": true}',
        "Café au lait, naïve façade, jalapeño, crème brûlée, Zürich, Łódź.",
        "Ünïcödé text: 東京, Москва, Αθήνα, القاهرة, 🙂 🚀 ✨",
        "Email: someone@example.com; URL: https://example.org/path?q=1&r=2",
        "Tabs\tand  double  spaces\nand new lines stay as they are.",
    ]
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", type=Path, help="output folder")
    parser.add_argument(
        "--arch",
        choices=sorted(ARCH_DEFAULTS),
        default="llama",
        help="architecture (default: llama)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    parser.add_argument("--force", action="store_true",
                        help="write into a folder that is not empty (its model is replaced)")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.force:
        # `splitserve tiny-model models/smollm2-135m-instruct` replaced the real weights with
        # random ones, and `make model` then took the folder for complete (a CLI audit).
        raise SystemExit(f"splitserve tiny-model: {out} exists and is not an empty folder; "
                         "choose another, or pass --force to replace what is there")
    path = build_tiny_model(out, arch=args.arch, seed=args.seed)
    print(f"tiny {args.arch} model written to {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m splitserve_cli.tiny_model", description=__doc__
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
