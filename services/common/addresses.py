"""host:port strings that hold for IPv6 literals too (an IPv6-only cluster gives pods addresses
like fd00::12): a literal with a colon is written in brackets, as gRPC and URLs read it."""

from __future__ import annotations

import ipaddress
import socket


def host_port(host: str, port: int | str) -> str:
    """`host:port`, with an IPv6 literal bracketed (`[fd00::12]:50051`)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def address_family(host: str) -> socket.AddressFamily:
    """The socket family that binds `host`: IPv6 for a literal with a colon (`::`, `::1`)."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def is_loopback(host: str) -> bool:
    """Whether `host` (a literal, bracketed or not, or "localhost") is this machine only."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost: it may resolve anywhere
        return False


def check_ports_free(program: str, ports: list[tuple[str, str, int]]) -> None:
    """Each fixed (flag, host, port) another process holds, refused in one line naming the
    flag before anything starts (port 0, any free one, and -1, off, are skipped). Probed as
    the servers bind, with SO_REUSEADDR: a port whose last listener left connections in
    TIME_WAIT (a process restarted on its address) is free to them. A port taken between
    this check and the bind still fails there."""
    for flag, host, port in ports:
        if port <= 0:
            continue
        try:
            with socket.socket(address_family(host), socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((host, port))
        except OSError as exc:
            raise SystemExit(f"{program}: {flag} {port} on {host} cannot be bound "
                             f"({exc.strerror}): another process holds it?") from None


def check_port(flag: str, port: int, off: bool = False) -> None:
    """A port flag's range, refused naming the flag: 0 is any free port, -1 (where `off`)
    turns the listener off."""
    if not (-1 if off else 0) <= port <= 65535:
        raise ValueError(f"{flag} must be in [0, 65535] (0: any free port)"
                         f"{', or -1 (off)' if off else ''}, got {port}")
