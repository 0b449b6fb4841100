"""The `splitserve` command: one subcommand per module, imported only when that subcommand runs.

Each command module exposes `add_arguments(parser)` and `run(args) -> int`. Adding a command is
one line in COMMANDS; `splitserve --help` imports none of them, so it stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class Command:
    module: str
    summary: str


COMMANDS: dict[str, Command] = {
    "model": Command(
        "splitserve_cli.prepare_model", "convert the bundled SmolLM2 GGUF into models/"
    ),
    "tiny-model": Command(
        "splitserve_cli.tiny_model", "write a tiny random model folder for tests"
    ),
    "prefill": Command("services.prefill.main", "run a prefill worker (gRPC + KV sender)"),
    "decode": Command("services.decode.main", "run a decode worker (gRPC + KV receiver)"),
    "worker": Command("services.common.worker_main", "run a worker in any role (both = aggregated)"),
    "gateway": Command("services.gateway.main", "run the OpenAI-compatible gateway (HTTP + gRPC)"),
    "up": Command("splitserve_cli.up", "start gateway + prefill + decode locally (make run)"),
    "standby": Command("splitserve_cli.standby", "list the warm pool (--standby workers) or activate some"),
    "autoscaler": Command("services.autoscaler.main", "size the prefill and decode pools (k8s or local)"),
    "profile": Command("splitserve_cli.profile", "measure a worker on this machine into profile.json"),
    "capacity": Command("services.autoscaler.capacity_cli", "capacity plan: workers for a rate and SLOs"),
    "cost": Command("splitserve_cli.cost", "cost per request, per 1k tokens and per tenant from the access log"),
    "doctor": Command("splitserve_cli.doctor", "the kernels and dtype this machine gives a model"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS:
        return _run_command(argv[0], argv[1:])
    # Only help, a missing or an unknown command get here; argparse prints and exits for those.
    _top_level_parser().parse_args(argv)
    return 2


def _top_level_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitserve",
        description="Disaggregated prefill/decode LLM serving.",
        epilog="Run `splitserve COMMAND --help` for a command's options.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        commands.add_parser(name, help=command.summary, add_help=False)
    return parser


# Worker processes keep torch's C++ warnings out of their JSON log unless TORCH_CPP_LOG_LEVEL
# says otherwise: a decode peer that went away made c10d print "sendBytes failed" with a
# 20-frame C++ trace, several times, beside the worker's own one-line warning for it (a
# migration audit). Read by libc10 when it loads, so set before the command imports torch.
_QUIET_CPP = ("worker", "prefill", "decode")


def _run_command(name: str, argv: list[str]) -> int:
    command = COMMANDS[name]
    if name in _QUIET_CPP:
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    module = _import_command(name, command)
    parser = argparse.ArgumentParser(prog=f"splitserve {name}", description=command.summary)
    module.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return int(module.run(args) or 0)
    except BrokenPipeError:  # `splitserve cost ... | head`: the reader has what it wanted
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - no flush error at exit either
        return 0
    except Exception as exc:
        if not _about_the_input(exc) or os.environ.get("SPLITSERVE_TRACEBACK"):
            raise
        # A missing or unreadable file, a taken port, a value out of range: one line naming
        # it, as for argparse's own errors (a CLI audit met 20 tracebacks for such input).
        print(f"splitserve {name}: error: {exc} ({type(exc).__name__}; "
              "SPLITSERVE_TRACEBACK=1 shows where)", file=sys.stderr)
        return 1


def _about_the_input(exc: Exception) -> bool:
    """Errors a command meets in what it was given (files, ports, memory, values), not bugs
    of its own; those keep their traceback."""
    if isinstance(exc, OSError | ValueError):
        return True
    if type(exc).__name__ == "SafetensorError":  # a corrupt or truncated model.safetensors
        return True
    # grpc's bind failure (a port in use) and torch's thread count
    return isinstance(exc, RuntimeError) and str(exc).startswith(
        ("Failed to bind", "set_num_threads"))


def _import_command(name: str, command: Command) -> ModuleType:
    try:
        module = importlib.import_module(command.module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (command.module + ".").startswith(exc.name + "."):
            raise SystemExit(
                f"splitserve {name}: module {command.module!r} does not exist "
                f"(COMMANDS in {__name__} points at it)"
            ) from exc
        raise SystemExit(
            f"splitserve {name}: {command.module} needs {exc.name!r}, which is not installed; "
            "run `make install`"
        ) from exc
    missing = [
        attr for attr in ("add_arguments", "run") if not callable(getattr(module, attr, None))
    ]
    if missing:
        raise SystemExit(
            f"splitserve {name}: {command.module} lacks {', '.join(a + '()' for a in missing)}"
        )
    return module


if __name__ == "__main__":
    sys.exit(main())
