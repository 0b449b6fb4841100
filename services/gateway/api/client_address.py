"""Which client a request comes from, for the fair queue's per-client shares of anonymous
traffic (Admission.share_of) and the access log.

The client is the connection's peer address, or, when that peer is a proxy the gateway trusts
(--forwarded-allow-ips), the address the proxies say they forwarded for: X-Forwarded-For read
from its right end, each entry added by the hop after it, up to the first that is not itself
a trusted proxy. An untrusted peer's X-Forwarded-For is ignored: anyone can write one, and it
would let a client be as many clients as it likes. An IPv6 client counts by its /64 (a host or
a site has one: Admission.share_of), an IPv4 client by its address; the log has the address.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from urllib.parse import unquote

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class ClientAddresses:
    def __init__(self, trusted: Iterable[str] = ()) -> None:
        """`trusted`: proxies' addresses or networks (CIDR), or "*" for any peer."""
        self._any = False
        networks = []
        for entry in (e.strip() for e in trusted):
            if entry == "*":
                self._any = True
                continue
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                raise ValueError(f"--forwarded-allow-ips: {entry!r} is not an IP address, a "
                                 "network (CIDR) or *") from None
        self._trusted = tuple(networks)

    def trusts(self, address: IPAddress) -> bool:
        return self._any or any(address in network for network in self._trusted)

    def client(self, peer: str | None, forwarded_for: Iterable[str] = ()) -> str:
        """The client's address ("" when the peer is not an IP address, e.g. a Unix socket)."""
        address = parse_ip(peer or "")
        if address is None:
            return ""
        if self.trusts(address):
            hops = [hop for line in forwarded_for for hop in line.split(",") if hop.strip()]
            for hop in reversed(hops):
                before = parse_ip(hop)
                if before is None:  # not an address: the last proxy's own word is all we have
                    break
                address = before
                if not self.trusts(address):
                    break
        return str(address)


def parse_ip(text: str) -> IPAddress | None:
    """An address as peers and proxies write it: bare, or with a port ("1.2.3.4:80",
    "[::1]:80"), or an IPv6 scope ("fe80::1%eth0"); None if it is none of these. An IPv4
    address mapped into IPv6 (a socket listening on "::" sees IPv4 peers so) is the IPv4
    one, which trusted networks and shares are written in."""
    text = text.strip()
    if text.startswith("["):
        text = text[1:].partition("]")[0]
    elif text.count(":") == 1:
        text = text.partition(":")[0]
    try:
        address = ipaddress.ip_address(text.partition("%")[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def grpc_peer_host(peer: str) -> str:
    """The address in a gRPC peer string ("ipv4:1.2.3.4:5", "ipv6:[::1]:5", URL-quoted in
    some versions); "" for a Unix socket or anything else."""
    kind, _, rest = unquote(peer or "").partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    if kind == "ipv6":
        return rest[1:].partition("]")[0] if rest.startswith("[") else ""
    return ""
