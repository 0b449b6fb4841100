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
