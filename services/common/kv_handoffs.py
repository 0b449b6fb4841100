"""The prompts' KV a prefill worker has computed and not yet handed to its decode workers.

A prefill step on a host shared with a decode worker runs while the decoder pauses for it
(services/common/core_share.py). Once the step ends, its prompts' KV still has to travel, and
a decoder that went back to stepping at once met that KV a few milliseconds into its next
step: the KV waited for the step to end, and the request for the one after it. In a traced
`make run`, a short prompt's KV waited 83 ms at p50 beside 64 streams whose steps took 95 ms,
between its transfer and its landing in the decoder's cache. The prefill worker therefore
holds its cores (stays active) until the step's KV has been handed over, up to HOLD_S, while
the paused decoder writes it into its cache at each poll of its pause, and the request joins
the decoder's very next step.

Written by the engine thread (a step's outputs) and by the KV sender threads (a transfer
settled); each change is one dict operation, atomic under the GIL.
"""

from __future__ import annotations

import time
from collections.abc import Callable

# Past the transfer of a long prompt's KV on one host (shared memory, tens of milliseconds
# for thousands of tokens); a transfer that takes longer is waited for no further.
HOLD_S = 0.05
# How often a holding worker looks whether the KV has left.
POLL_S = 0.0005


class KVHandoffs:
    def __init__(self, hold_s: float = HOLD_S) -> None:
        self.hold_s = hold_s
        self._until: dict[int, float] = {}  # id of an output's KV -> when to stop waiting

    def computed(self, kv) -> None:
        """A step produced `kv` for a request whose caller waits for it."""
        self.pending()  # drops what expired (KV whose caller left before sending it)
        self._until[id(kv)] = time.monotonic() + self.hold_s

    def settled(self, kv) -> None:
        """`kv`'s transfer is done, failed or never happened: nothing waits on it."""
        self._until.pop(id(kv), None)

    def pending(self) -> bool:
        """Whether KV computed within hold_s is still on its way."""
        if not self._until:
            return False
        now = time.monotonic()
        for key, until in list(self._until.items()):
            if until <= now:
                self._until.pop(key, None)
        return bool(self._until)

    def hold(self, interrupted: Callable[[], bool]) -> bool:
        """The engine thread, before it lends its cores: waits while KV is pending, until
        `interrupted()`. True if interrupted (new work: keep the cores and take it)."""
        while self.pending():
            if interrupted():
                return True
            time.sleep(POLL_S)
        return False
