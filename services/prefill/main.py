"""`splitserve prefill`: a prefill worker."""

from __future__ import annotations

import argparse

from services.common.worker_cli import add_worker_arguments, worker_config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_worker_arguments(parser, role="prefill")


def run(args: argparse.Namespace) -> int:
    from services.common.server import run_worker

    return run_worker(worker_config_from_args(args, role="prefill"))
