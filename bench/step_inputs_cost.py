"""Benchmark: host time to pack a CUDA graph's decode inputs (engine/step_inputs.py), the work
the host does per graph replay before the copy to the device.

The inputs of a batch of decode rows padded to the graph's batch: ids, positions, slots and
context lengths, and the block table at the graphs' full width (8,192 tokens in blocks of 16:
512 columns), each row holding its context's blocks (8 to 128, drawn with a fixed seed). Two
ways of filling the same preallocated int64 host buffer (the pinned staging buffer on CUDA)
are timed side by side in this run, alternating, best of --repeats:

- list: the parts flattened into one Python list (padding included), then assigned to the
  buffer (how StepInputs packed before);
- write: StepInputs' way, each part written into the buffer's numpy view, a table row by row
  with its padding filled.

No device is needed: the copy that follows is the same either way.

    python bench/step_inputs_cost.py [--batches 32,256] [--width 512] [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from engine.step_inputs import Table  # noqa: E402


def by_list(parts: list, table: Table, buffer: np.ndarray) -> None:
    flat: list[int] = []
    for part in parts:
        flat.extend(part)
    for row in table.rows:
        flat.extend(row)
        flat.extend([table.fill] * (table.width - len(row)))
    flat.extend([table.fill] * ((table.num_rows - len(table.rows)) * table.width))
    buffer[: len(flat)] = flat


def by_write(parts: list, table: Table, buffer: np.ndarray) -> None:
    at = 0
    for part in parts:
        buffer[at : at + len(part)] = part
        at += len(part)
    rows, width = table.shape
    table.write_into(buffer[at : at + rows * width].reshape(rows, width))


def best_ms(fn, parts, table, buffer, loops: int) -> float:
    start = time.perf_counter()
    for _ in range(loops):
        fn(parts, table, buffer)
    return (time.perf_counter() - start) / loops * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="32,256", help="graph batch sizes")
    parser.add_argument("--width", type=int, default=512, help="block-table columns")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--loops", type=int, default=50, help="packs per timing")
    args = parser.parse_args()
    rng = random.Random(0)
    print(f"host time to pack a decode graph's inputs, block table {args.width} wide "
          f"(best of {args.repeats} x {args.loops} packs)")
    print(f"{'batch':>6} {'list (ms)':>10} {'write (ms)':>11} {'list / write':>13}")
    for batch in (int(b) for b in args.batches.split(",")):
        rows = [list(range(rng.randint(8, 128))) for _ in range(batch)]
        parts = [[1] * batch, [100] * batch, [7] * batch, [100] * batch]
        table = Table(rows, args.width, num_rows=batch)
        buffer = np.empty(batch * (4 + args.width), dtype=np.int64)
        check = buffer.copy()
        by_list(parts, table, check)
        by_write(parts, table, buffer)
        assert (check == buffer).all(), "the two ways packed different buffers"
        timings: dict[str, list[float]] = {"list": [], "write": []}
        for _ in range(args.repeats):
            for name, fn in (("list", by_list), ("write", by_write)):
                timings[name].append(best_ms(fn, parts, table, buffer, args.loops))
        old, new = min(timings["list"]), min(timings["write"])
        print(f"{batch:>6} {old:>10.3f} {new:>11.3f} {old / new:>12.1f}x", flush=True)


if __name__ == "__main__":
    main()
