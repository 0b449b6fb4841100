"""Which implementation each hot op of a model runner uses (C++ kernel or torch reference), as
the one line the engine logs at start and `splitserve doctor` prints."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KernelPaths:
    """What ModelRunner chose, in words a user can check against the README."""

    decode_attention: str
    prefill_attention: str
    linear: str
    fused_decode: str
    dtype: str
    device: str

    @classmethod
    def of(cls, *, device: torch.device, dtype: torch.dtype, native_decode: bool,
           native_prefill: bool, small_m_linear: bool, fused_decode: bool, head_dim: int,
           query_heads_per_kv_head: int, small_m_max_rows: int, weight_layout: str = "plain",
           triton: bool = False, shared_prefixes: bool = False) -> KernelPaths:
        if triton:  # CUDA, or the tests' interpreter on CPU
            return cls("triton paged decode attention (split-K)",
                       "triton varlen prefill attention over the paged prefix",
                       "torch F.linear", "off (triton RMS norm, rotary + KV write)",
                       _name(dtype), str(device))
        if device.type != "cpu":
            torch_path = "torch reference (--attention-backend torch)"
            return cls(torch_path, torch_path, "torch F.linear", "off", _name(dtype), str(device))
        if native_decode:
            wide = (torch.backends.cpu.get_cpu_capability() == "AVX512" and head_dim == 64
                    and 1 <= query_heads_per_kv_head <= 4)
            decode = "cpp paged_decode_attention (" + (
                "AVX-512 head_dim-64" if wide else "portable") + (
                ", shared prefixes once" if shared_prefixes else "") + ")"
        else:
            decode = "torch SDPA reference"
        torch_linear = {"amx": "cpp amx_linear (AMX tiles, packed weights)",
                        "packed": "torch F.linear (oneDNN packed weights)"}.get(weight_layout,
                                                                               "torch F.linear")
        return cls(
            decode_attention=decode,
            prefill_attention=_cpp_prefill() if native_prefill else "torch SDPA reference",
            linear=f"cpp small_m_linear (AVX-512 BF16, <= {small_m_max_rows} rows), {torch_linear} above"
            if small_m_linear else torch_linear,
            fused_decode="cpp decode_layers" if fused_decode else "off (per-layer modules)",
            dtype=_name(dtype),
            device=str(device),
        )

    def __str__(self) -> str:
        return (f"kernels on {self.device} in {self.dtype}: decode attention {self.decode_attention}; "
                f"prefill attention {self.prefill_attention}; linear {self.linear}; "
                f"fused decode {self.fused_decode}")


def _cpp_prefill() -> str:
    """The C++ prefill attention takes AMX tiles where the CPU has them (has_amx_bf16)."""
    tiles = torch.ops.splitserve_cpu.has_amx_bf16()
    return f"cpp prefill_attention ({'AMX tiles' if tiles else 'AVX-512 BF16'})"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
