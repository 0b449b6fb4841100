"""`splitserve standby`: list the warm pool (workers started with --standby), or activate some
of them (`--activate ID ...`, or `--activate-role decode --count 2`), which then join the
registry and serve within about a second."""

from __future__ import annotations

import argparse
import os
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379"))
    parser.add_argument("--cluster-secret-file", default=os.environ.get(
        "SPLITSERVE_CLUSTER_SECRET_FILE", ""),
                        help="the cluster secret: entries are checked with it and activations "
                             "signed with it")
    parser.add_argument("--activate", nargs="+", default=[], metavar="ID",
                        help="activate these standby workers")
    parser.add_argument("--activate-role", choices=("prefill", "decode", "both"),
                        help="activate --count standby workers of this role")
    parser.add_argument("--count", type=int, default=1)


def run(args: argparse.Namespace) -> int:
    from services.common.security import read_cluster_secret
    from services.common.standby import activate, list_standby

    secret = read_cluster_secret(args.cluster_secret_file) if args.cluster_secret_file else None
    try:
        pool = list_standby(args.redis_url, secret)
    except Exception as exc:  # noqa: BLE001 - one line, not a traceback
        raise SystemExit(f"splitserve standby: cannot read {args.redis_url}: {exc}") from None
    chosen = list(args.activate)
    short = False  # fewer of the role stand by than --count asks: exit 1, after activating them
    if args.activate_role:
        if args.count < 1:
            raise SystemExit("splitserve standby: --count must be >= 1")
        of_role = sorted(w.worker_id for w in pool if w.role == args.activate_role)
        if len(of_role) < args.count:
            print(f"only {len(of_role)} {args.activate_role} workers stand by", file=sys.stderr)
            short = True
        chosen += of_role[: args.count]
    if not chosen:
        if short:
            return 1
        if not pool:
            print("no standby workers")
        for info in sorted(pool, key=lambda w: (w.role, w.worker_id)):
            print(f"{info.worker_id}\t{info.role}\t{info.address}\tstart-up "
                  f"{info.stats.get('startup_s', '?')} s")
        return 0
    known = {w.worker_id for w in pool}
    status = 0
    for worker_id in chosen:
        if worker_id not in known:
            print(f"{worker_id}: not in the standby pool", file=sys.stderr)
            status = 1
            continue
        activate(args.redis_url, worker_id, secret)
        print(f"{worker_id}: activated")
    return 1 if short else status
