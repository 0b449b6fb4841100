"""The python steps of bench/gpu/check.sh: what the machine has (env), Triton kernels against
the torch reference and SDPA (kernels: max error and time), the engine against transformers
(parity) and timed on an 8B shape (engine; both in engine_check.py), and the summary table.

    python bench/gpu/check.py env|kernels|parity|engine|summary --out DIR [--smoke]
Each step writes DIR/<step>.json. Without CUDA, kernels, parity and engine record that they
skipped (exit 0); `--smoke` runs them on CPU under TRITON_INTERPRET=1 at tiny sizes instead
(times meaningless: it only checks this script's code paths).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

# What the device script uses (required) and what the wider issue #22 check will want.
REQUIRED = ("torch", "triton", "pytest")
OPTIONAL = ("numpy", "transformers", "safetensors", "grpc", "pytest_timeout")


def write(out: Path, step: str, data: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{step}.json").write_text(json.dumps(data, indent=2) + "\n")


def step_env(out: Path) -> int:
    """Versions, the GPU, and what is missing; exit 1 when a required package is."""
    found, missing = {}, []
    for name in REQUIRED + OPTIONAL:
        try:
            module = importlib.import_module(name)
            found[name] = getattr(module, "__version__", "installed")
        except Exception as exc:  # a broken install counts as missing, with its reason
            missing.append(f"{name} ({type(exc).__name__}: {exc})"[:200])
    data = {"python": platform.python_version(), "packages": found, "missing": missing,
            "cuda": False}
    if "torch" in found:
        import torch

        data["cuda"] = torch.cuda.is_available()
        data["torch_cuda"] = torch.version.cuda
        if data["cuda"]:
            props = torch.cuda.get_device_properties(0)
            data["gpu"] = props.name
            data["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
            data["capability"] = f"{props.major}.{props.minor}"
    for key, value in data.items():
        print(f"{key}: {value}", flush=True)
    write(out, "env", data)
    required_missing = [m for m in missing if m.split(" ")[0] in REQUIRED]
    return 1 if required_missing or not data["cuda"] else 0


def cuda_ms(fn, device, warmup: int = 3, iters: int = 20) -> float:
    """Median milliseconds of fn() (CUDA events on a GPU, wall clock on CPU)."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def paged_cache(total_tokens, kv_heads, head_dim, block_size, dtype, device, gen):
    """A cache with room for `total_tokens` (+ spare blocks), its blocks in shuffled order."""
    import torch

    num_blocks = -(-total_tokens // block_size) + 4
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    return k, v, order


def table_of(order, length, block_size, device):
    import torch

    return torch.tensor([order.pop() for _ in range(-(-length // block_size))], device=device)


def decode_case(batch, ctx, heads, kv_heads, head_dim, block_size, dtype, device, iters):
    import torch
    import torch.nn.functional as F

    from kernels.attention import gather_blocks, paged_decode_attention
    from kernels.triton.decode_attention import triton_paged_decode_attention

    gen = torch.Generator().manual_seed(batch * 7 + ctx)
    k_cache, v_cache, order = paged_cache(batch * ctx, kv_heads, head_dim, block_size, dtype,
                                          device, gen)
    tables = torch.stack([table_of(order, ctx, block_size, device) for _ in range(batch)])
    lens = torch.full((batch,), ctx, dtype=torch.long, device=device)
    query = torch.randn(batch, heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    scale = head_dim**-0.5
    ref32 = paged_decode_attention(query.float(), k_cache.float(), v_cache.float(), tables,
                                   lens, ctx, scale)
    out = triton_paged_decode_attention(query, k_cache, v_cache, tables, lens, ctx, scale)
    # SDPA on contiguous K/V (what a non-paged engine would run; flash where it applies)
    keys = gather_blocks(k_cache, tables).flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
    values = gather_blocks(v_cache, tables).flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
    q4 = query.unsqueeze(2)
    return {
        "max_error": (out.float() - ref32).abs().max().item(),
        "triton_ms": cuda_ms(lambda: triton_paged_decode_attention(
            query, k_cache, v_cache, tables, lens, ctx, scale), device, iters=iters),
        "reference_ms": cuda_ms(lambda: paged_decode_attention(
            query, k_cache, v_cache, tables, lens, ctx, scale), device, iters=iters),
        "sdpa_contiguous_ms": cuda_ms(lambda: F.scaled_dot_product_attention(
            q4, keys, values, scale=scale, enable_gqa=True), device, iters=iters),
    }


def prefill_case(num_seqs, q_len, ctx, heads, kv_heads, head_dim, block_size, dtype, device,
                 iters):
    """num_seqs sequences of q_len new tokens over contexts of ctx (a cached prefix of
    ctx - q_len), packed, their K/V already in the paged cache."""
    import torch
    import torch.nn.functional as F

    from kernels.attention import gather_blocks, prefill_attention
    from kernels.triton.prefill_attention import triton_prefill_attention

    gen = torch.Generator().manual_seed(num_seqs * 7 + ctx + q_len)
    k_cache, v_cache, order = paged_cache(num_seqs * ctx, kv_heads, head_dim, block_size, dtype,
                                          device, gen)
    tables = torch.stack([table_of(order, ctx, block_size, device) for _ in range(num_seqs)])
    seqs = [(i * q_len, q_len, ctx) for i in range(num_seqs)]
    query = torch.randn(num_seqs * q_len, heads, head_dim, generator=gen).to(device=device,
                                                                            dtype=dtype)
    scale = head_dim**-0.5
    contexts = [(gather_blocks(k_cache, tables[i]).flatten(0, 1)[:ctx],
                 gather_blocks(v_cache, tables[i]).flatten(0, 1)[:ctx]) for i in range(num_seqs)]

    def reference(q, kv):  # the torch path: per sequence, context read back from the cache
        return torch.cat([prefill_attention(q[s:s + n], k, v, scale)
                          for (s, n, _), (k, v) in zip(seqs, kv, strict=True)])

    def reference_with_gather():
        kv = [(gather_blocks(k_cache, tables[i]).flatten(0, 1)[:ctx],
               gather_blocks(v_cache, tables[i]).flatten(0, 1)[:ctx]) for i in range(num_seqs)]
        return reference(query, kv)

    ref32 = reference(query.float(), [(k.float(), v.float()) for k, v in contexts])
    out = triton_prefill_attention(query, k_cache, v_cache, seqs, tables, scale)
    result = {
        "max_error": (out.float() - ref32).abs().max().item(),
        "triton_ms": cuda_ms(lambda: triton_prefill_attention(
            query, k_cache, v_cache, seqs, tables, scale), device, iters=iters),
        "reference_ms": cuda_ms(reference_with_gather, device, iters=iters),
    }
    if q_len == ctx:  # flash's causal path on contiguous K/V, one call per sequence
        q4 = [query[s:s + n].transpose(0, 1).unsqueeze(0) for s, n, _ in seqs]
        kv4 = [(k.transpose(0, 1).unsqueeze(0).contiguous(), v.transpose(0, 1).unsqueeze(0)
                .contiguous()) for k, v in contexts]
        result["sdpa_contiguous_ms"] = cuda_ms(lambda: [F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            for q, (k, v) in zip(q4, kv4, strict=True)], device, iters=iters)
    flops = 4 * heads * head_dim * num_seqs * (q_len * (ctx - q_len) + q_len * (q_len + 1) / 2)
    result["triton_tflops"] = flops / (result["triton_ms"] * 1e-3) / 1e12
    return result


def rmsnorm_case(rows, hidden, dtype, device, iters):
    import torch

    from engine.layers.norm import RMSNorm
    from kernels.triton.rmsnorm import triton_rmsnorm

    gen = torch.Generator().manual_seed(rows)
    x, res = (torch.randn(rows, hidden, generator=gen).to(device=device, dtype=dtype)
              for _ in range(2))
    norm = RMSNorm(hidden, 1e-5).to(device=device, dtype=dtype)
    ref, _ = norm(x, res, "torch")
    out, _ = triton_rmsnorm(x, norm.weight, 1e-5, res)
    return {
        "max_error": (out.float() - ref.float()).abs().max().item(),
        "triton_ms": cuda_ms(lambda: triton_rmsnorm(x, norm.weight, 1e-5, res), device,
                             iters=iters),
        "reference_ms": cuda_ms(lambda: norm(x, res, "torch"), device, iters=iters),
    }


def rotary_kv_case(tokens, heads, kv_heads, head_dim, block_size, dtype, device, iters):
    import torch

    from engine.layers.rotary import RotaryEmbedding
    from kernels.attention import store_kv
    from kernels.triton.rotary_kv import triton_rotary_kv

    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(
        device=device, dtype=dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    q, k, v = q.view(tokens, heads, -1), k.view(tokens, kv_heads, -1), v.view(tokens, kv_heads, -1)
    k_cache, v_cache, _ = paged_cache(tokens, kv_heads, head_dim, block_size, dtype, device, gen)
    slots = torch.randperm(k_cache.shape[0] * block_size, generator=gen)[:tokens].to(device)
    rotary = RotaryEmbedding(head_dim, 8192, 500000.0)
    positions = torch.randint(0, 8192, (tokens,), generator=gen)
    cos, sin = (t.to(device) for t in rotary.cos_sin(positions, dtype))

    def reference():
        qr = RotaryEmbedding.rotate(q, (cos, sin))
        store_kv(RotaryEmbedding.rotate(k, (cos, sin)), v, k_cache, v_cache, slots)
        return qr

    ref = reference()
    out = triton_rotary_kv(q, k, v, cos, sin, k_cache, v_cache, slots)
    return {
        "max_error": (out.float() - ref.float()).abs().max().item(),
        "triton_ms": cuda_ms(lambda: triton_rotary_kv(q, k, v, cos, sin, k_cache, v_cache, slots),
                             device, iters=iters),
        "reference_ms": cuda_ms(reference, device, iters=iters),
    }


def kernel_cases(smoke: bool) -> list[tuple[str, str, object, dict]]:
    """(kernel, shape label, case function, its arguments): real sizes (an 8B-shaped Llama:
    32 query / 8 KV heads of 128, blocks of 16), or tiny ones for --smoke."""
    if smoke:
        d = dict(heads=4, kv_heads=2, head_dim=16, block_size=4)
        return [
            ("decode", "B2 ctx9", decode_case, dict(batch=2, ctx=9, **d)),
            ("prefill", "1x8 ctx8", prefill_case, dict(num_seqs=1, q_len=8, ctx=8, **d)),
            ("prefill", "2x4 ctx10", prefill_case, dict(num_seqs=2, q_len=4, ctx=10, **d)),
            ("rmsnorm", "3x24", rmsnorm_case, dict(rows=3, hidden=24)),
            ("rotary_kv", "5 tokens", rotary_kv_case, dict(tokens=5, **d)),
        ]
    d = dict(heads=32, kv_heads=8, head_dim=128, block_size=16)
    cases = [("decode", f"B{b} ctx{c}", decode_case, dict(batch=b, ctx=c, **d))
             for b, c in ((1, 4096), (32, 2048), (128, 1024), (256, 512), (8, 32768))]
    cases += [("prefill", f"{n}x{q} ctx{c}", prefill_case, dict(num_seqs=n, q_len=q, ctx=c, **d))
              for n, q, c in ((1, 4096, 4096), (4, 1024, 1024), (8, 512, 2048), (1, 2048, 8192))]
    cases += [("rmsnorm", f"{r}x4096", rmsnorm_case, dict(rows=r, hidden=4096))
              for r in (1, 256, 4096)]
    cases += [("rotary_kv", f"{t} tokens", rotary_kv_case, dict(tokens=t, **d))
              for t in (1, 256, 4096)]
    return cases


def step_kernels(out: Path, smoke: bool) -> int:
    import torch

    if smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--smoke needs TRITON_INTERPRET=1 (the kernels run interpreted on CPU)")
            return 2
        device, dtype, iters = torch.device("cpu"), torch.float32, 2
    elif not torch.cuda.is_available():
        print("kernels: skipped, no CUDA device")
        write(out, "kernels", {"skipped": "no CUDA device", "rows": []})
        return 0
    else:
        device, dtype, iters = torch.device("cuda"), torch.bfloat16, 20
    rows, failed = [], 0
    for kernel, shape, case, args in kernel_cases(smoke):
        start = time.perf_counter()
        row = {"kernel": kernel, "shape": shape, "dtype": str(dtype).removeprefix("torch.")}
        try:
            with torch.no_grad():
                row.update(case(dtype=dtype, device=device, iters=iters, **args))
            row["speedup_vs_reference"] = row["reference_ms"] / row["triton_ms"]
        except Exception as exc:  # one failing shape (e.g. out of memory) must not end the rest
            failed += 1
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        row["seconds"] = round(time.perf_counter() - start, 1)
        rows.append(row)
        print(format_row(row), flush=True)
        write(out, "kernels", {"device": str(device), "smoke": smoke, "rows": rows})
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 1 if failed else 0


def format_row(row: dict) -> str:
    if "error" in row:
        return f"{row['kernel']:<10} {row['shape']:<14} {row['dtype']:<8} FAILED {row['error']}"
    sdpa = row.get("sdpa_contiguous_ms")
    return (f"{row['kernel']:<10} {row['shape']:<14} {row['dtype']:<8} max err {row['max_error']:9.3g}  "
            f"triton {row['triton_ms']:8.3f} ms  reference {row['reference_ms']:8.3f} ms "
            f"({row['speedup_vs_reference']:5.2f}x)"
            + (f"  sdpa {sdpa:8.3f} ms" if sdpa is not None else "")
            + (f"  {row['triton_tflops']:.0f} TFLOP/s" if "triton_tflops" in row else ""))


def step_summary(out: Path) -> int:
    """summary.json (every step's status and data) and summary.txt (the table)."""
    steps = []
    status_file = out / "steps.tsv"
    if status_file.exists():
        for line in status_file.read_text().splitlines():
            name, rc, seconds = (line.split("\t") + ["", ""])[:3]
            steps.append({"step": name, "rc": rc, "seconds": seconds})
    data = {"steps": steps}
    for name in ("env", "kernels", "parity", "engine"):
        path = out / f"{name}.json"
        if path.exists():
            data[name] = json.loads(path.read_text())
    data["tests"] = [junit_counts(p) for p in sorted(out.glob("*.xml"))]
    lines = ["splitserve bench/gpu/check.sh summary", ""]
    env = data.get("env", {})
    lines.append(f"gpu: {env.get('gpu', 'none')}  torch {env.get('packages', {}).get('torch')}  "
                 f"triton {env.get('packages', {}).get('triton')}  missing: "
                 f"{', '.join(env.get('missing', [])) or 'nothing'}")
    lines += ["", "steps (rc 0 ok, 124 timed out):"]
    lines += [f"  {s['step']:<16} rc {s['rc']:<4} {s['seconds']} s" for s in steps]
    lines += ["", "gpu-marked tests:"]
    lines += [f"  {t['file']}: {t['passed']} passed, {t['failed']} failed, {t['skipped']} "
              f"skipped" for t in data["tests"]] or ["  (no results)"]
    kernels = data.get("kernels", {})
    lines += ["", "kernels (median times; reference: the torch path on the same device; sdpa: "
              "SDPA over K/V copied contiguous):"]
    if kernels.get("skipped"):
        lines.append(f"  skipped: {kernels['skipped']}")
    lines += ["  " + format_row(row) for row in kernels.get("rows", [])]
    lines += engine_lines(data)
    text = "\n".join(lines) + "\n"
    (out / "summary.txt").write_text(text)
    write(out, "summary", data)
    print(text)
    return 0


def engine_lines(data: dict) -> list[str]:
    from bench.gpu.engine_check import format_engine, format_parity

    lines = ["", "engine against transformers (greedy, random weights):"]
    parity = data.get("parity", {})
    lines += [f"  skipped: {parity['skipped']}"] if parity.get("skipped") else []
    lines += ["  " + format_parity(row) for row in parity.get("rows", [])] or ["  (no results)"]
    engine = data.get("engine")
    lines += ["", "engine timings:"]
    if not engine:
        return lines + ["  (no results)"]
    if engine.get("skipped") or "shape" not in engine:
        return lines + [f"  skipped: {engine.get('skipped', engine)}"]
    return lines + ["  " + line for line in format_engine(engine)]


def junit_counts(path: Path) -> dict:
    import xml.etree.ElementTree as ET

    try:
        suites = ET.parse(path).getroot()
        suite = suites if suites.tag == "testsuite" else suites.find("testsuite")
        total, failed = int(suite.get("tests", 0)), int(suite.get("failures", 0))
        errors, skipped = int(suite.get("errors", 0)), int(suite.get("skipped", 0))
        return {"file": path.name, "passed": total - failed - errors - skipped,
                "failed": failed + errors, "skipped": skipped}
    except Exception as exc:  # a half-written report from a killed run
        return {"file": path.name, "passed": 0, "failed": f"unreadable ({exc})", "skipped": 0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=("env", "kernels", "parity", "engine", "summary"))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/gpu/out")))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU, interpreted")
    args = parser.parse_args()
    if args.step == "env":
        return step_env(args.out)
    if args.step == "kernels":
        return step_kernels(args.out, args.smoke)
    if args.step in ("parity", "engine"):
        from bench.gpu.engine_check import run_step

        return run_step(args.step, args.smoke, lambda data: write(args.out, args.step, data))
    return step_summary(args.out)


if __name__ == "__main__":
    sys.exit(main())
