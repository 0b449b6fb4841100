"""`splitserve gateway`: the OpenAI-compatible gateway in front of prefill/decode workers."""

from __future__ import annotations

import argparse

from services.gateway.config import add_gateway_arguments, gateway_config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_gateway_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from services.gateway.server import run_gateway

    try:
        config = gateway_config_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"splitserve gateway: {exc}") from None
    return run_gateway(config)
