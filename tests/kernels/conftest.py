"""Kernel tests: without CUDA the Triton kernels run under Triton's interpreter.

TRITON_INTERPRET is set here, before any test module imports triton, and left set: triton.jit
and each launch read it (no other test in the suite runs a Triton kernel on CPU)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
