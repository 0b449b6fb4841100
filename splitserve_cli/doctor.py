"""`splitserve doctor`: what this machine gives a worker, before one starts: the CPU's vector
instructions, whether the C++ kernels build (and why not), and for a model the dtype and the
path each hot op takes (the line the engine logs at start)."""

from __future__ import annotations

import argparse
import os

import torch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=os.environ.get("SPLITSERVE_MODEL",
                                                          "models/smollm2-135m-instruct"))
    parser.add_argument("--dtype", default=os.environ.get("SPLITSERVE_DTYPE", "auto"))
    parser.add_argument("--device", default="auto")


def run(args: argparse.Namespace) -> int:
    from engine.config import EngineConfig, ModelConfig, cpu_has_fast_bf16
    from engine.model_runner import ModelRunner
    from kernels import cpu_kernels

    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"native bf16 dot products: {'yes' if cpu_has_fast_bf16() else 'no'}")
    if cpu_kernels.load():
        print("C++ CPU kernels: built")
    else:
        print(f"C++ CPU kernels: NOT built, the torch reference runs instead: {cpu_kernels.build_error()}")
    model = ModelConfig.from_dir(args.model)  # refuses what the engine cannot serve, by name
    windows = sorted(set(model.layer_windows) - {0})
    print(f"model {args.model}: {model.architecture}, {model.num_layers} layers, head_dim "
          f"{model.head_dim}, rope scaling {(model.rope_scaling or {}).get('rope_type', 'none')}, "
          f"sliding window {windows or 'none'}, qkv bias {'yes' if model.attention_bias else 'no'}")
    # A pool of one context (mapped lazily: no memory is written): one block made the engine
    # warn that requests were limited to 16 tokens, which the user never asked for.
    block_size = EngineConfig.block_size
    config = EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                          num_kv_blocks=-(-model.max_position_embeddings // block_size))
    print(ModelRunner(config, model).kernel_paths)
    return 0
