"""Compile the Triton kernels (attention, RMSNorm, rotary + KV write) ahead of time for a CUDA architecture, on any machine:
triton's wheel brings ptxas, so a CPU-only host checks that they build to cubin for a GPU, and
reads from ptxas how many registers each program uses and how many bytes it spills.

    python -m kernels.triton.compile_check [--arch 90] [--all]
Needs TRITON_INTERPRET unset (the interpreter replaces the compiler).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
from triton.compiler import ASTSource

from kernels.triton import decode_attention, prefill_attention, rmsnorm, rotary_kv

HEAD_DIM = 128
BLOCK_SIZE = 16


def _signature(fn, pointers: dict[str, str], constexprs: dict) -> dict[str, str]:
    """Every argument not named is an int32 (lengths, strides) except scale and eps, floats."""
    types = {"scale": "fp32", "eps": "fp32", **pointers}
    return {name: "constexpr" if name in constexprs else types.get(name, "i32")
            for name in fn.arg_names}


def variants(dtype: str, full: bool) -> list[tuple[str, object, dict, dict, int]]:
    """(label, kernel, pointer types, constexprs, warps) of the shapes a Llama of head_dim 128
    uses, tiled as the launchers tile them."""
    groups = (1, 3, 4, 8) if full else (4,)
    out = []
    kv = {"q_ptr": dtype, "k_cache_ptr": dtype, "v_cache_ptr": dtype, "out_ptr": dtype,
          "tables_ptr": "i64"}
    for group in groups:
        group_pad = triton.next_power_of_2(group)
        for splits in (1, 8) if full else (8,):
            consts = dict(GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=HEAD_DIM, DIM_PAD=HEAD_DIM,
                          BLOCK_SIZE=BLOCK_SIZE,
                          BLOCK_N=decode_attention.decode_block_n(group_pad, HEAD_DIM),
                          NUM_SPLITS=splits)
            ptrs = {**kv, "seq_lens_ptr": "i64", "part_max_ptr": "fp32", "part_sum_ptr": "fp32",
                    "part_acc_ptr": "fp32"}
            out.append((f"decode {dtype} gqa{group} splits{splits}",
                        decode_attention._decode_split_kernel, ptrs, consts,
                        decode_attention.NUM_WARPS))
        consts = dict(GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=HEAD_DIM, DIM_PAD=HEAD_DIM,
                      BLOCK_SIZE=BLOCK_SIZE, BLOCK_M=max(prefill_attention.ROWS // group_pad, 1),
                      BLOCK_N=prefill_attention.prefill_block_n(
                          torch.float32 if dtype == "fp32" else torch.bfloat16,
                          torch.device("cuda")),
                      UPCAST=False, PRECISION="ieee" if dtype == "fp32" else None)
        ptrs = {**kv, "q_starts_ptr": "i64", "q_lens_ptr": "i64", "ctx_lens_ptr": "i64"}
        out.append((f"prefill {dtype} gqa{group}", prefill_attention._prefill_kernel, ptrs, consts,
                    prefill_attention.NUM_WARPS))
    consts = dict(HEAD_DIM=HEAD_DIM, DIM_PAD=HEAD_DIM, NUM_SPLITS=8)
    ptrs = {"out_ptr": dtype, "part_max_ptr": "fp32", "part_sum_ptr": "fp32", "part_acc_ptr": "fp32"}
    out.append((f"decode reduce {dtype}", decode_attention._decode_reduce_kernel, ptrs, consts,
                4))
    bf16 = dtype == "bf16"
    consts = dict(HAS_RESIDUAL=True, ROUND_BEFORE_WEIGHT=bf16, BF16=bf16, BLOCK=4096)
    ptrs = {name: dtype for name in ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr")}
    out.append((f"rmsnorm {dtype}", rmsnorm._rmsnorm_kernel, ptrs, consts,
                rmsnorm.num_warps(4096)))
    consts = dict(NUM_HEADS=32, HEADS_PAD=32, KV_HEADS=8, KV_PAD=8, HEAD_DIM=HEAD_DIM,
                  DIM_PAD=HEAD_DIM, BLOCK_SIZE=BLOCK_SIZE, BF16=bf16)
    ptrs = {name: dtype for name in ("q_ptr", "k_ptr", "v_ptr", "cos_ptr", "sin_ptr", "q_out_ptr",
                                     "k_cache_ptr", "v_cache_ptr")}
    out.append((f"rotary_kv {dtype}", rotary_kv._rotary_kv_kernel, {**ptrs, "slots_ptr": "i64"},
                consts, 4))
    return out


def registers(ptx: str, arch: int) -> tuple[int, int]:
    """(registers per thread, bytes of spill stores) of a kernel's PTX, from `ptxas -v` as
    triton runs it (the compiled kernel reports them only once loaded on a device)."""
    with tempfile.TemporaryDirectory() as folder:
        source = f"{folder}/kernel.ptx"
        with open(source, "w") as f:
            f.write(ptx)
        done = subprocess.run([get_ptxas(arch).path, "-v", "--regAllocOptLevel=2",
                               f"--gpu-name={sm_arch_from_capability(arch)}", source,
                               "-o", f"{folder}/kernel.cubin"],
                              capture_output=True, text=True, check=True)
    used = re.search(r"Used (\d+) registers", done.stderr)
    spilled = re.search(r"(\d+) bytes spill stores", done.stderr)
    return int(used.group(1)) if used else 0, int(spilled.group(1)) if spilled else 0


def compile_all(arch: int = 90, full: bool = False) -> list[str]:
    """Compile each variant to cubin for sm_`arch`; one line per kernel (raises if one fails)."""
    target = GPUTarget("cuda", arch, 32)
    lines = []
    for dtype in ("bf16", "fp32") if full else ("bf16",):
        for label, fn, ptrs, consts, warps in variants(dtype, full):
            start = time.perf_counter()
            pointers = {name: f"*{t}" for name, t in ptrs.items()}
            src = ASTSource(fn=fn, signature=_signature(fn, pointers, consts), constexprs=consts)
            kernel = triton.compile(src, target=target, options={"num_warps": warps})
            used, spilled = registers(kernel.asm["ptx"], arch)
            lines.append(f"{label}: sm_{arch} cubin of {len(kernel.asm['cubin'])} bytes, "
                         f"{kernel.metadata.shared} B shared memory, {warps} warps, "
                         f"{used} registers, {spilled} B spilled, "
                         f"{time.perf_counter() - start:.1f} s")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90, 80")
    parser.add_argument("--all", action="store_true", help="every GQA ratio, split and dtype")
    args = parser.parse_args()
    for line in compile_all(args.arch, args.all):
        print(line, flush=True)


if __name__ == "__main__":
    main()
