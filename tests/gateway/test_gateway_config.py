"""Gateway and launcher configuration, the chat template, and the gateway staying torch-free."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from services.gateway.api.tokenizer import ModelTokenizer
from services.gateway.config import GatewayConfig, add_gateway_arguments, gateway_config_from_args
from splitserve_cli.up import UpConfig


def _parse(argv, monkeypatch=None, env=None):
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    parser = argparse.ArgumentParser()
    add_gateway_arguments(parser)
    return gateway_config_from_args(parser.parse_args(argv))


def test_flags_and_environment_build_one_typed_config(tiny_llama_dir, monkeypatch):
    config = _parse(["--model", str(tiny_llama_dir), "--prefill", "a:1,b:2", "--decode", "c:3",
                     "--max-body-bytes", "1MiB"], monkeypatch,
                    env={"SPLITSERVE_GATEWAY_PORT": "9001",
                         "SPLITSERVE_GATEWAY_SLOW_CLIENT_TIMEOUT_S": "2.5"})
    assert config.prefill == ("a:1", "b:2") and config.decode == ("c:3",)
    assert config.port == 9001 and config.slow_client_timeout_s == 2.5
    assert config.max_body_bytes == 1 << 20 and config.disaggregated
    assert config.model_name == tiny_llama_dir.name
    assert "api_keys=<0 keys>" in config.describe()


@pytest.mark.parametrize("routing", [
    {}, {"prefill": ("a:1",)}, {"worker": ("a:1",), "decode": ("b:2",)}])
def test_config_needs_one_clear_deployment(tiny_llama_dir, routing):
    with pytest.raises(ValueError):
        GatewayConfig(model=str(tiny_llama_dir), **routing)


def test_api_keys_are_not_printed(tiny_llama_dir):
    # Not the word "secret": a flag's name (--cluster-secret-file) may contain it.
    config = GatewayConfig(model=str(tiny_llama_dir), worker=("a:1",), api_keys=("k3y-x9q",))
    assert "k3y-x9q" not in config.describe()


def test_gateway_process_does_not_import_torch():
    code = ("import sys, services.gateway.server, services.gateway.main; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(("cores", "prefill", "decode"), [(1, 1, 1), (2, 1, 1), (16, 8, 8)])
def test_up_splits_cores_between_the_workers(tiny_llama_dir, monkeypatch, cores, prefill, decode):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)))
    threads = UpConfig(model=str(tiny_llama_dir)).threads()
    assert (threads["prefill"], threads["decode"], threads["both"]) == (prefill, decode, cores)


def test_chat_template_renders_like_transformers(smollm2_dir):
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": "And of Italy?"}]
    ours = ModelTokenizer(smollm2_dir)
    hf = AutoTokenizer.from_pretrained(str(smollm2_dir))
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.render_chat(messages) == expected
    assert ours.encode_chat(messages) == hf.encode(expected, add_special_tokens=False)
