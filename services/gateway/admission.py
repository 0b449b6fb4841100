"""Admission at the gateway: API keys (401) and in-flight limits, gateway-wide (503, capacity)
and per key (429, quota). Quotas and fair queueing shared through Redis come later behind
this same `admit` call. Owned by the event loop."""

from __future__ import annotations

import hmac
from collections import Counter
from dataclasses import dataclass, field

from services.gateway.errors import APIError


@dataclass
class Ticket:
    """A request's admission; `release` it exactly once when the request is done."""

    admission: Admission
    key: str
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission._release(self)


@dataclass
class Admission:
    api_keys: tuple[str, ...] = ()
    max_inflight: int = 0
    max_inflight_per_key: int = 0
    inflight: int = 0
    _per_key: Counter = field(default_factory=Counter)

    def authenticate(self, authorization: str | None) -> str:
        """The caller's key ("" when authentication is off); raises 401 otherwise."""
        if not self.api_keys:
            return ""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() == "bearer":
            for key in self.api_keys:
                if hmac.compare_digest(token.strip().encode(), key.encode()):
                    return key
        raise APIError.unauthorized()

    def admit(self, key: str) -> Ticket:
        if self.max_inflight and self.inflight >= self.max_inflight:
            raise APIError.overloaded(
                f"The gateway is at its limit of {self.max_inflight} requests in flight; retry.")
        if self.max_inflight_per_key and self._per_key[key] >= self.max_inflight_per_key:
            raise APIError.rate_limited(
                f"At most {self.max_inflight_per_key} requests in flight per API key; retry "
                "when one finishes.")
        self.inflight += 1
        self._per_key[key] += 1
        return Ticket(self, key)

    def _release(self, ticket: Ticket) -> None:
        self.inflight -= 1
        self._per_key[ticket.key] -= 1
        if self._per_key[ticket.key] <= 0:
            del self._per_key[ticket.key]
