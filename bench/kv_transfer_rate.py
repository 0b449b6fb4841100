"""Benchmark: kv_transfer (send -> on_kv) against raw ProcessGroupGloo send/recv, same two processes.

kv_transfer is timed both ways it moves a payload between two processes on one host: through
its shared-memory region (what co-located workers use by default) and over gloo's TCP pair
(what workers on different hosts use; here a second sender with the region turned off). Each
mode also reports the CPU time both processes spent per payload.

Run from the repo root:  .venv/bin/python -m bench.kv_transfer_rate  [--sizes-mib 1 16 64] [--reps 15]
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path; the repository root must come
# before it (tests/bench/test_bench_layout.py keeps bench/ from shadowing a package).
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from kv_transfer import KVLayout, KVReceiver, KVSender  # noqa: E402

# 256 KiB per block: a 4-layer, 8-KV-head, head_dim 128 model slice with 16-token blocks, fp32.
LAYOUT = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16, dtype="float32")
# kv_fresh: gloo with every buffer kept by on_kv, so each payload lands in fresh memory.
MODES = ("raw", "kv_gloo", "kv_shm", "kv_fresh")
BYTES_PER_REP = 64 << 20  # each repetition streams this many bytes back to back
TIMEOUT_S = 30.0


def _blocks(mib: int) -> int:
    return max(1, (mib << 20) // LAYOUT.bytes_per_block)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _sender_main(conn, endpoint: str, raw_port: int) -> None:
    """The prefill side: obeys (mode, mib, count) commands from the parent; answers with the
    CPU seconds the commands took here."""
    torch.set_num_threads(1)
    raw_store = dist.TCPStore(
        "127.0.0.1", raw_port, is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT_S)
    )
    raw = dist.ProcessGroupGloo(
        dist.PrefixStore("raw", raw_store), 1, 2, datetime.timedelta(seconds=TIMEOUT_S)
    )
    senders = {
        "kv_shm": KVSender(endpoint, LAYOUT, "cpu", TIMEOUT_S, max_queued=1024),
        "kv_gloo": KVSender(endpoint, LAYOUT, "cpu", TIMEOUT_S, max_queued=1024,
                            shared_memory_bytes=0),
    }
    for sender in senders.values():
        sender.wait_ready()
    if senders["kv_shm"].transport != "shared memory":
        raise RuntimeError(f"the shared-memory sender went over {senders['kv_shm'].transport}")
    payloads: dict[int, torch.Tensor] = {}
    conn.send("ready")
    while True:
        command = conn.recv()
        if command is None:
            break
        mode, mib, count = command
        if mib not in payloads:  # made once: making it is slower than sending it
            payloads[mib] = torch.randn(LAYOUT.payload_shape(_blocks(mib)))
        kv = payloads[mib]
        cpu_start = _cpu_seconds()
        if mode == "raw":
            flat = kv.reshape(-1).view(torch.uint8)
            for _ in range(count):
                raw.send([flat], 0, 0).wait()
        else:
            sender = senders["kv_gloo" if mode == "kv_fresh" else mode]
            futures = [sender.send(f"bench-{i}", 1, 1, kv) for i in range(count)]
            for future in futures:
                future.result()
        conn.send(_cpu_seconds() - cpu_start)
    for sender in senders.values():
        sender.close()


class _Arrivals:
    """on_kv for the benchmark: counts payloads; releases them to the pool unless told not to."""

    def __init__(self) -> None:
        self.receiver: KVReceiver | None = None
        self.release = True
        self.count = 0
        self.target = 0
        self.done = threading.Event()
        self.kept: list[torch.Tensor] = []

    def __call__(self, header, payload: torch.Tensor) -> None:
        if self.release:
            self.receiver.release(payload)
        else:
            self.kept.append(payload)  # owner keeps it: the next transfer needs a fresh buffer
            del self.kept[:-1]
        self.count += 1
        if self.count == self.target:
            self.done.set()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)

    arrivals = _Arrivals()
    receiver = KVReceiver("127.0.0.1", 0, LAYOUT, "cpu", arrivals, TIMEOUT_S)
    arrivals.receiver = receiver
    raw_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    conn, child_conn = mp.get_context("spawn").Pipe()
    child = mp.get_context("spawn").Process(
        target=_sender_main, args=(child_conn, receiver.endpoint, raw_store.port), daemon=True
    )
    child.start()
    raw = dist.ProcessGroupGloo(
        dist.PrefixStore("raw", raw_store), 0, 2, datetime.timedelta(seconds=TIMEOUT_S)
    )
    if conn.recv() != "ready":
        raise RuntimeError("sender process failed to start")
    print(
        f"layout {LAYOUT}, {args.reps} reps x {BYTES_PER_REP >> 20} MiB per size and mode",
        flush=True,
    )
    load_before = os.getloadavg()[0]

    results: dict[tuple[int, str], list[float]] = {}
    cpu_ms: dict[tuple[int, str], list[float]] = {}  # both processes, per payload
    for mib in args.sizes_mib:
        nblocks = _blocks(mib)
        nbytes = LAYOUT.payload_nbytes(nblocks)
        count = max(2, BYTES_PER_REP // nbytes)
        raw_buf = torch.empty(nbytes, dtype=torch.uint8)  # raw baseline reuses one buffer
        for rep in range(-1, args.reps):  # rep -1 warms up every path
            shift = rep % len(MODES)
            order = MODES[shift:] + MODES[:shift]  # rotate so no mode always goes first
            line = []
            for mode in order:
                arrivals.count, arrivals.target = 0, count
                arrivals.release = mode != "kv_fresh"
                arrivals.done.clear()
                cpu_start = _cpu_seconds()
                start = time.perf_counter()
                conn.send((mode, mib, count))
                if mode == "raw":
                    for _ in range(count):
                        raw.recv([raw_buf], 1, 0).wait()
                elif not arrivals.done.wait(TIMEOUT_S):
                    raise RuntimeError(f"kv transfers did not arrive: {receiver.stats.snapshot()}")
                seconds = time.perf_counter() - start
                sender_cpu = conn.recv()
                if not isinstance(sender_cpu, float):
                    raise RuntimeError("sender process failed")
                per_payload_ms = (sender_cpu + _cpu_seconds() - cpu_start) / count * 1e3
                arrivals.kept.clear()
                gbps = count * nbytes / seconds / 1e9
                line.append(f"{mode} {gbps:5.2f}")
                if rep >= 0:
                    results.setdefault((mib, mode), []).append(gbps)
                    cpu_ms.setdefault((mib, mode), []).append(per_payload_ms)
            tag = "warmup" if rep < 0 else f"rep {rep + 1}/{args.reps}"
            print(
                f"  [{mib:3d} MiB x {count:3d}] {tag:>9}: " + "  ".join(line) + "  GB/s", flush=True
            )

    conn.send(None)
    child.join(TIMEOUT_S)
    receiver.close()

    print()
    print("| payload | raw gloo GB/s | kv over gloo GB/s (/ raw) | kv through shared memory GB/s "
          "(/ kv over gloo) | CPU ms per payload, gloo / shared memory | kv over gloo, buffer "
          "kept by on_kv GB/s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for mib in args.sizes_mib:
        med = {mode: statistics.median(results[(mib, mode)]) for mode in MODES}
        cpu = {mode: statistics.median(cpu_ms[(mib, mode)]) for mode in MODES}
        print(
            f"| {mib} MiB | {med['raw']:.2f} | {med['kv_gloo']:.2f} "
            f"({med['kv_gloo'] / med['raw']:.2f}x) | {med['kv_shm']:.2f} "
            f"({med['kv_shm'] / med['kv_gloo']:.2f}x) | {cpu['kv_gloo']:.1f} / "
            f"{cpu['kv_shm']:.1f} | {med['kv_fresh']:.2f} |"
        )
    print(
        "GB/s = 1e9 bytes/s, medians; kv columns include the doorbell and the on_kv hand-off; "
        "CPU ms is user + system time of both processes over the payloads sent. 1-min load "
        f"average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after on {os.cpu_count()} "
        "CPUs: other load on the host shows up as noise."
    )


if __name__ == "__main__":
    main()
