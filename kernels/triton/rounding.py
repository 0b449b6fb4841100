"""Float32 -> bfloat16 rounding for the Triton kernels that must round as torch does."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_bf16(x, TO_BF16: tl.constexpr):
    """x (float32) -> the nearest bfloat16, ties to even, still held in float32, when TO_BF16
    (else x). Done on the bits: the interpreter's own float32 -> bfloat16 cast truncates, and a
    value rounded here casts exactly on either side."""
    if TO_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x
