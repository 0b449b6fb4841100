"""A torch.distributed TCPStore server listening on one address only. Given a host, torch's
store server still listens on every interface: a decode worker started with `--host
127.0.0.1` had its KV port open to the whole network (an audit listed its keys and broke a
channel from another host). Here the listening socket is bound to the host first and handed
to the store, which takes it over (and closes it with the store)."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist


def bound_store(host: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """A master TCPStore listening on `host`:`port` alone (port 0: one the system picks; the
    store's `port` says which). "0.0.0.0" or "::" still mean every interface."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
        bound_port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    return dist.TCPStore(host, bound_port, is_master=True, wait_for_workers=False,
                         timeout=timeout, master_listen_fd=sock.detach())
