"""What the fair queue's release pass costs with many clients waiting: each anonymous client
address is a share of its own, and every drain (each admission, each finished request, each
20 ms tick while requests wait) asks which waiting heads are owed a slot now.

    python -m bench.owed_scan [--clients 500,2000,8000] [--limit 64]

For each N it queues one request from each of N clients and times, in the same run, the pass
the gateway makes (`FairQueue.owed`, one pass over the shares) against asking `within_share`
head by head, as admission did until December 7 (a pass over the shares per head: N²). The
ratio is the figure; absolute times move with this VM's state.
"""

from __future__ import annotations

import argparse
import time

from services.gateway.admission.fair_queue import FairQueue
from services.gateway.admission.tenants import Tenant

ANONYMOUS = Tenant()


class _Request:
    def __init__(self, share: str) -> None:
        self.tenant, self.share = ANONYMOUS, share
        self.prompt_tokens, self.max_output_tokens, self.slots, self.seq = 32, 64, 1, 0


def _best_of(repeats: int, run) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="500,2000,8000")
    parser.add_argument("--limit", type=int, default=64, help="the in-flight limit")
    args = parser.parse_args()
    print(f"{'clients':>8} {'one pass (ms)':>14} {'head by head (ms)':>18} {'ratio':>8}")
    for n in (int(c) for c in args.clients.split(",")):
        queue = FairQueue()
        for i in range(n):
            queue.push(_Request(f"anonymous/10.{i >> 16}.{(i >> 8) & 255}.{i & 255}"))
        one = _best_of(5, lambda q=queue: q.owed(args.limit))
        each = _best_of(1 if n > 2000 else 3, lambda q=queue: [
            h for h in q.heads() if q.within_share(h, args.limit)])
        print(f"{n:>8} {one * 1000:>14.1f} {each * 1000:>18.1f} {each / one:>7.0f}x", flush=True)


if __name__ == "__main__":
    main()
