"""Tenants and API keys changed without a restart: the gateway re-reads the tenants file and
the API-keys file when their contents change (checked every --tenants-reload-s) or on SIGHUP,
and swaps the directory admission authenticates against. A file that fails to load keeps the
directory in use: the error is logged and counted, and the next change is tried again.

Requests already admitted keep the settings they were admitted with; the next request of a
tenant meets its new weight, quota and limits, and a removed key is refused from then on.
Kubernetes updates a mounted ConfigMap or Secret in place (within its sync period, about a
minute), so quota edits and key rotation reach the gateways without rolling them.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable, Sequence

from prometheus_client import Counter

from services.gateway.admission.tenants import TenantDirectory

log = logging.getLogger(__name__)


def _fingerprint(paths: Sequence[str]) -> str:
    """A digest of the files' contents (a missing or unreadable file counts as a content of
    its own, so its return is a change too)."""
    digest = hashlib.sha256()
    for path in paths:
        try:
            with open(path, "rb") as f:
                digest.update(hashlib.sha256(f.read()).digest())
        except OSError as exc:
            digest.update(f"unreadable:{exc.errno}".encode())
    return digest.hexdigest()


class TenantsWatcher:
    """Owned by the gateway's event loop; `reload()` may also be called from a signal handler
    registered on that loop."""

    def __init__(self, admission, build: Callable[[], TenantDirectory], paths: Sequence[str],
                 interval_s: float, registry) -> None:
        self.admission = admission
        self.build = build
        self.paths = [p for p in paths if p]
        self.interval_s = interval_s
        self._seen = _fingerprint(self.paths)
        self._task: asyncio.Task | None = None
        self.reloads = Counter(
            "splitserve_gateway_tenants_reloads",
            "Re-reads of the tenants and API-keys files, by result (ok, error: the directory "
            "in use was kept).", ["result"], registry=registry)

    async def start(self) -> None:
        if self.paths and self.interval_s > 0:
            self._task = asyncio.create_task(self._watch(), name="tenants-watch")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if _fingerprint(self.paths) != self._seen:
                self.reload()

    def reload(self) -> bool:
        """Builds the directory from the files as they are now and puts it in use; on any
        error keeps the one in use. True when the new one is in use."""
        self._seen = _fingerprint(self.paths)
        try:
            directory = self.build()
        except Exception as exc:  # whatever the files hold, the gateway serves on
            self.reloads.labels("error").inc()
            log.error("tenants not reloaded, keeping the ones in use: %s", exc)
            return False
        if self.admission.directory.auth_enabled and not directory.auth_enabled:
            # An emptied key file must not open the gateway to everyone.
            self.reloads.labels("error").inc()
            log.error("tenants not reloaded, keeping the ones in use: the files now hold no "
                      "API key, which would turn authentication off (restart to do that)")
            return False
        self.admission.directory = directory
        self.reloads.labels("ok").inc()
        log.info("tenants reloaded: %s", directory.describe())
        return True
