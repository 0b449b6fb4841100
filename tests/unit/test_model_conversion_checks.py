"""`splitserve model` refuses a GGUF it cannot convert before building anything, with one line
naming why: transformers fills missing settings with Llama's 7B defaults, and a GGUF without
them grew the conversion to all of the machine's memory until the kernel killed it (a CLI
audit). Real GGUF files written with the `gguf` package, and the bundled SmolLM2 one."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFWriter

from splitserve_cli.prepare_model import check_gguf, convert, find_bundled_gguf


def _write(path, arch: str = "llama", **settings) -> None:
    writer = GGUFWriter(str(path), arch=arch)
    for key, value in settings.items():
        if key == "tokens":
            writer.add_token_list(value)
        else:
            writer.add_uint32(f"{arch}.{key.replace('__', '.')}", value)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


SHAPE = {"block_count": 2, "embedding_length": 8, "attention__head_count": 2,
         "feed_forward_length": 16, "tokens": ["a", "b", "c"]}


@pytest.mark.parametrize(("case", "expected"), [
    ("no settings", "lacks the model settings llama.block_count"),
    ("bert", "architecture 'bert'"),
    ("random bytes", "is not a readable GGUF file"),
    ("missing", "is not a file"),
    ("too large", "GiB of memory is available"),
])
def test_a_gguf_that_cannot_be_converted_is_refused_in_one_line(tmp_path, case, expected):
    path = tmp_path / "model.gguf"
    if case == "no settings":
        _write(path)
    elif case == "bert":
        _write(path, arch="bert", **SHAPE)
    elif case == "random bytes":
        path.write_bytes(np.random.default_rng(0).bytes(4096))
    elif case == "too large":  # 1,000 layers of 16k: about 4T parameters
        _write(path, **{**SHAPE, "block_count": 1000, "embedding_length": 16384,
                        "feed_forward_length": 65536})
    with pytest.raises(SystemExit) as refused:
        check_gguf(path)
    assert expected in str(refused.value) and "\n" not in str(refused.value)
    out = tmp_path / "out"
    with pytest.raises(SystemExit):
        convert(path, out)
    assert not out.exists() and list(tmp_path.glob(".out.tmp-*")) == []  # nothing left behind


def test_the_bundled_model_and_a_small_complete_gguf_pass(tmp_path):
    check_gguf(find_bundled_gguf())
    _write(tmp_path / "small.gguf", **SHAPE)
    check_gguf(tmp_path / "small.gguf")


def test_tiny_model_will_not_write_over_a_model_folder(tmp_path):
    """`splitserve tiny-model models/smollm2-135m-instruct` replaced the real weights with
    random ones (exit 0), and `splitserve model` then took the folder for complete."""
    import argparse
    import json

    from splitserve_cli import tiny_model
    from splitserve_cli.prepare_model import REQUIRED_FILES, is_complete

    folder = tmp_path / "model"
    folder.mkdir()
    for name in REQUIRED_FILES:
        (folder / name).write_text("{}")
    (folder / "conversion.json").write_text(json.dumps({"weights_bytes": 2}))
    assert is_complete(folder)
    args = argparse.Namespace(out=folder, arch="llama", seed=0, force=False)
    with pytest.raises(SystemExit) as refused:
        tiny_model.run(args)
    assert "is not an empty folder" in str(refused.value)
    assert (folder / "model.safetensors").read_text() == "{}"  # untouched
    tiny_model.run(argparse.Namespace(**{**vars(args), "force": True}))
    assert not is_complete(folder)  # weights of another size: `splitserve model` reconverts
    assert tiny_model.run(argparse.Namespace(out=tmp_path / "new", arch="llama", seed=0,
                                             force=False)) == 0


@pytest.mark.parametrize(("argv", "expected"), [
    (["doctor", "--model", "/nonexistent/model"], "no config.json"),
    (["model", "--out", "{tmp}/out", "--gguf", "{tmp}/missing.gguf"], "is not a file"),
    (["tiny-model", "/proc/1/no-such/model"], "splitserve tiny-model: error: "),
])
def test_bad_input_to_a_command_is_one_line_not_a_traceback(tmp_path, argv, expected):
    """A missing file, a folder it cannot write: one line and exit 1, as argparse's own errors
    (a CLI audit met tracebacks for 20 such inputs); SPLITSERVE_TRACEBACK=1 shows where."""
    import os
    import subprocess
    import sys

    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    env = {k: v for k, v in os.environ.items() if k != "SPLITSERVE_TRACEBACK"}
    done = subprocess.run([sys.executable, "-m", "splitserve_cli.main", *argv], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert expected in done.stderr and "Traceback" not in done.stderr, done.stderr
    loud = subprocess.run([sys.executable, "-m", "splitserve_cli.main", *argv],
                          env={**env, "SPLITSERVE_TRACEBACK": "1"}, capture_output=True,
                          text=True, timeout=120)
    assert loud.returncode == 1
    assert "Traceback" in loud.stderr or expected in loud.stderr  # SystemExit has none
