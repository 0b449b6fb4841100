"""Triton fused residual add + RMSNorm against the torch RMSNorm of engine/layers/norm.py.

Without CUDA the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set in
conftest.py) on small shapes; the `gpu` tests run the same checks compiled on CUDA at real
sizes and are skipped here.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # TRITON_INTERPRET is set in conftest.py without CUDA

import kernels.triton.rmsnorm as rmsnorm_module  # noqa: E402
from engine.layers.norm import RMSNorm  # noqa: E402
from kernels.triton.rmsnorm import triton_rmsnorm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16_ULP = 2.0**-7  # one bfloat16 ulp relative to a value's magnitude
EPS = 1e-5


def make_case(rows, hidden, dtype, device, seed=0):
    """x, residual and a non-trivial weight, as a model layer sees them (all in `dtype`)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen) * 3
    residual = torch.randn(rows, hidden, generator=gen)
    weight = 1 + torch.randn(hidden, generator=gen) * 0.2
    to = dict(device=device, dtype=dtype)
    return x.to(**to), residual.to(**to), weight.to(**to)


def reference_norm(weight, eps):
    norm = RMSNorm(weight.shape[0], eps).to(device=weight.device, dtype=weight.dtype)
    norm.weight.data.copy_(weight)
    return norm


def check_against_reference(rows, hidden, dtype, with_residual, device=DEVICE):
    """The new residual is bit-identical (one rounded add); the output differs from the torch
    path at most by the order of the mean's float32 sum: 1e-5 relative for float32, one bf16
    ulp of the output's magnitude for bfloat16 (a rounding on either side of a tie)."""
    x, residual, weight = make_case(rows, hidden, dtype, device, seed=rows * 1000 + hidden)
    ref_module = reference_norm(weight, EPS)
    if with_residual:
        out, new_residual = triton_rmsnorm(x, weight, EPS, residual)
        ref, ref_residual = ref_module(x, residual, backend="torch")
        assert new_residual.dtype == dtype
        assert torch.equal(new_residual, ref_residual)
    else:
        out = triton_rmsnorm(x, weight, EPS)
        ref = ref_module(x, backend="torch")
    assert out.shape == x.shape and out.dtype == dtype
    err = (out.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    bound = 1e-5 * scale if dtype == torch.float32 else BF16_ULP * scale
    print(f"rows {rows} hidden {hidden} {dtype} residual {with_residual}: max error {err:.3g} "
          f"(bound {bound:.3g})")
    assert err <= bound, f"max error {err} over {bound}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no_residual"])
@pytest.mark.parametrize("hidden", [7, 33, 100], ids=["h7", "h33", "h100"])
@pytest.mark.parametrize("rows", [1, 37], ids=["one_row", "many_rows"])
def test_rmsnorm_matches_torch_reference(rows, hidden, dtype, with_residual):
    check_against_reference(rows, hidden, dtype, with_residual)


def test_rmsnorm_keeps_leading_shape_and_reads_strided_rows():
    """A [2, 3, hidden] input and a column slice of a wider tensor (row stride != hidden)."""
    x, residual, weight = make_case(6, 24, torch.float32, DEVICE)
    wide = torch.cat([x, x], dim=1)[:, :24]  # strided rows
    out, new_residual = triton_rmsnorm(wide.view(2, 3, 24), weight, EPS, residual.view(2, 3, 24))
    ref, ref_residual = reference_norm(weight, EPS)(x, residual)
    assert out.shape == (2, 3, 24)
    torch.testing.assert_close(out.view(6, 24), ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(new_residual.view(6, 24), ref_residual)


def test_rmsnorm_of_no_rows_is_empty():
    x, residual, weight = make_case(1, 16, torch.float32, DEVICE)
    out, new_residual = triton_rmsnorm(x[:0], weight, EPS, residual[:0])
    assert out.shape == (0, 16) and new_residual.shape == (0, 16)


def test_rmsnorm_refuses_mismatched_inputs():
    x, residual, weight = make_case(2, 16, torch.float32, DEVICE)
    with pytest.raises(ValueError, match="weight of shape"):
        triton_rmsnorm(x, weight[:8], EPS)
    with pytest.raises(ValueError, match="does not match"):
        triton_rmsnorm(x, weight, EPS, residual[:, :8])
    with pytest.raises(ValueError, match="does not match"):
        triton_rmsnorm(x, weight, EPS, residual.double())
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        triton_rmsnorm(x.double(), weight.double(), EPS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")
@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
def test_cpu_norm_never_takes_the_kernel(backend, monkeypatch):
    """CPU behaviour is unchanged whatever the backend (triton included, which the
    interpreter would otherwise allow): the kernel is replaced by one that fails if called."""

    def refuse(*args, **kwargs):
        raise AssertionError("the Triton RMSNorm ran on CPU")

    monkeypatch.setattr(rmsnorm_module, "triton_rmsnorm", refuse)
    x, residual, weight = make_case(3, 16, torch.bfloat16, "cpu")
    norm = reference_norm(weight, EPS)
    out, new_residual = norm(x, residual, backend)
    ref, ref_residual = norm(x, residual)
    assert torch.equal(out, ref) and torch.equal(new_residual, ref_residual)


# --- compiled on CUDA at real sizes (skipped without a GPU) --------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hidden", [576, 2048, 4096, 8192])
@pytest.mark.parametrize("rows", [1, 256, 4096])
def test_gpu_rmsnorm_matches_torch_reference(rows, hidden, dtype):
    check_against_reference(rows, hidden, dtype, True, device="cuda")
    check_against_reference(rows, hidden, dtype, False, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_gpu_norm_module_takes_the_kernel(backend, monkeypatch):
    """On CUDA the module's auto and triton backends run the kernel; torch keeps the reference."""
    calls = []
    real = rmsnorm_module.triton_rmsnorm

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(rmsnorm_module, "triton_rmsnorm", counting)
    x, residual, weight = make_case(8, 576, torch.bfloat16, "cuda")
    norm = reference_norm(weight, EPS)
    norm(x, residual, "torch")
    assert not calls
    out, _ = norm(x, residual, backend)
    ref, _ = norm(x, residual, "torch")
    assert calls == [1]
    assert (out.float() - ref.float()).abs().max().item() <= BF16_ULP * ref.float().abs().max().item()
