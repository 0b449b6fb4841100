"""Tenants: who a caller is (API key -> tenant), what it may use (weight, priority class,
token rate, concurrency, queue and length limits) and whose prefix cache it shares (its own
unless it names a cache group). Keys are kept only as SHA-256 digests.

Built once at start-up from the tenants file (YAML) and the API-key secret; read-only after.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import yaml

from services.gateway.errors import APIError

ANONYMOUS = "anonymous"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_SALT_DOMAIN = b"splitserve cache salt v1\x00"


@dataclass(frozen=True)
class Tenant:
    """One tenant's settings. 0 means "no limit" for every limit below."""

    name: str = ANONYMOUS
    weight: float = 1.0  # share of the cluster relative to other backlogged tenants
    priority: int = 0  # strict classes: a higher class is always served first
    tokens_per_minute: int = 0  # prompt + generated tokens, refilled continuously
    burst_tokens: int = 0  # token bucket size (0: one minute's worth)
    max_concurrency: int = 0  # requests admitted and not finished, across all gateways
    max_queued: int = 0  # requests waiting in this gateway's fair queue
    max_prompt_tokens: int = 0  # longer prompts are a 400
    max_output_tokens: int = 0  # max_tokens is capped at this
    # Tenants naming the same group share cached prompt blocks (a common system prompt);
    # empty: the tenant's blocks are its own.
    cache_group: str = ""

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"tenant name {self.name!r}: use 1-64 of A-Z a-z 0-9 _ . -")
        if self.cache_group and not _NAME.match(self.cache_group):
            raise ValueError(f"tenant {self.name}: cache_group {self.cache_group!r}: use 1-64 "
                             "of A-Z a-z 0-9 _ . -")
        if not self.weight > 0:
            raise ValueError(f"tenant {self.name}: weight must be > 0")
        for f in dataclasses.fields(self):
            if f.type == "int" and getattr(self, f.name) < 0 and f.name != "priority":
                raise ValueError(f"tenant {self.name}: {f.name} must be >= 0")

    @property
    def bucket_size(self) -> int:
        return self.burst_tokens or self.tokens_per_minute

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_minute / 60.0

    @property
    def cache_salt(self) -> str:
        """What the workers seed this tenant's block hashes with: requests with different
        salts never hit each other's cached blocks. The anonymous tenant (no API keys) keeps
        the unsalted cache everyone shared before tenants. Tenant and group names live in
        separate namespaces, so a group can never alias a tenant's private cache."""
        if self.cache_group:
            return f"group:{self.cache_group}"
        return "" if self.name == ANONYMOUS else f"tenant:{self.name}"


_SETTINGS = {f.name for f in dataclasses.fields(Tenant)} - {"name"}


def key_digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


class TenantDirectory:
    """API key digests -> tenants. Authentication is on when any key is known."""

    def __init__(self, tenants: Iterable[Tenant], keys: dict[str, str],
                 anonymous: Tenant | None = None, salt_key: bytes | None = None) -> None:
        """`salt_key` (the cluster secret) keys the cache salts; see cache_salt."""
        self.tenants = {t.name: t for t in tenants}
        self._salt_key = salt_key
        for name in keys.values():
            if name not in self.tenants:
                raise ValueError(f"an API key names tenant {name!r}, which is not defined")
        self._keys = dict(keys)  # sha256 hex -> tenant name
        self.anonymous = anonymous or Tenant()
        if not self._keys:
            self.tenants = {self.anonymous.name: self.anonymous}

    @property
    def auth_enabled(self) -> bool:
        return bool(self._keys)

    def authenticate(self, authorization: str | None) -> Tenant:
        """The caller's tenant; raises 401 for a missing or unknown key when auth is on."""
        if not self._keys:
            return self.anonymous
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise APIError.unauthorized()
        # Looked up by digest: lookup timing can reveal at most a digest prefix, which says
        # nothing about any key.
        name = self._keys.get(key_digest(token))
        if name is None:
            raise APIError.unauthorized()
        return self.tenants[name]

    def cache_salt(self, tenant: Tenant, client_salt: str = "") -> str:
        """The salt the workers seed `tenant`'s block hashes with. Keyed by the cluster secret
        when there is one, so whoever reads the prefix events in Redis cannot recompute a
        tenant's chain to test a guessed prompt; every gateway with the secret agrees.
        `client_salt` (a request's own cache_salt, as vLLM takes it) splits the tenant's cache
        further, never joins another's: its digest goes after the tenant's salt, behind a '/'
        that no tenant or group name holds."""
        salt = tenant.cache_salt
        if client_salt:
            salt += "/salt:" + hashlib.sha256(client_salt.encode("utf-8", "surrogatepass")).hexdigest()
        if not salt or self._salt_key is None:
            return salt
        return hmac.new(self._salt_key, _SALT_DOMAIN + salt.encode(), hashlib.sha256).hexdigest()

    def describe(self) -> str:
        return (f"{len(self.tenants)} tenants ({', '.join(sorted(self.tenants))}), "
                f"{len(self._keys)} API keys, auth {'on' if self.auth_enabled else 'off'}")


def load_tenants(tenants_file: str = "", api_keys: Iterable[str] = (),
                 defaults: dict | None = None, salt_key: bytes | None = None) -> TenantDirectory:
    """The directory from the tenants file (may be "") and the key secret's entries.

    A secret entry `tenant:key` binds a key to a tenant of the file; a bare `key` is a tenant
    of its own (named after its digest) with the default settings. `defaults` are settings
    from flags, overridden by the file's `defaults:` and then by each tenant's own.
    """
    base = dict(defaults or {})
    raw = _read(tenants_file) if tenants_file else {}
    unknown = set(raw) - {"defaults", "tenants"}
    if unknown:
        raise ValueError(f"{tenants_file}: unknown top-level keys {sorted(unknown)} "
                         "(expected `defaults` and `tenants`)")
    base.update(_settings(raw.get("defaults") or {}, "defaults", tenants_file))
    tenants: list[Tenant] = []
    keys: dict[str, str] = {}
    for name, body in (raw.get("tenants") or {}).items():
        if not isinstance(body or {}, dict):
            raise ValueError(f"{tenants_file}: tenant {name}: expected a mapping of settings")
        body = dict(body or {})
        digests = body.pop("api_key_sha256", [])
        digests = digests if isinstance(digests, list) else [digests]
        tenants.append(_tenant(str(name), {**base, **_settings(body, name, tenants_file)}))
        for digest in digests:
            if not isinstance(digest, str) or not _SHA256.match(digest.strip().lower()):
                raise ValueError(f"{tenants_file}: tenant {name}: {digest!r} is not a SHA-256 "
                                 "hex digest (64 characters 0-9a-f, quoted)")
            digest = digest.strip().lower()
            _bind(keys, digest, str(name))
    names = {t.name for t in tenants}
    for entry in (e.strip() for e in api_keys):
        if not entry:
            continue
        name, sep, key = entry.partition(":")
        if sep and name in names:
            _bind(keys, key_digest(key), name)
        else:
            digest = key_digest(entry)
            own = f"key-{digest[:12]}"
            if own not in names:
                tenants.append(_tenant(own, base))
                names.add(own)
            _bind(keys, digest, own)
    if tenants_file and not keys:
        raise ValueError(f"{tenants_file} defines tenants but no API key reaches any of them: "
                         "add api_key_sha256 to a tenant or `tenant:key` to the API keys")
    return TenantDirectory(tenants, keys, _tenant(ANONYMOUS, base), salt_key)


def _read(path: str) -> dict:
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"cannot read the tenants file: {exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path} is not valid YAML: {exc}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping with `tenants:`")
    return raw


def _settings(body: dict, where: str, path: str) -> dict:
    if not isinstance(body, dict):
        raise ValueError(f"{path}: {where}: expected a mapping of settings")
    unknown = set(body) - _SETTINGS
    if unknown:
        raise ValueError(f"{path}: {where}: unknown settings {sorted(unknown)}; "
                         f"known: {sorted(_SETTINGS)} and api_key_sha256")
    return dict(body)


def _tenant(name: str, settings: dict) -> Tenant:
    values = {}
    for f in dataclasses.fields(Tenant):
        if f.name in settings:
            if f.type == "str":
                if not isinstance(settings[f.name], str):
                    raise ValueError(f"tenant {name}: {f.name} must be a string, "
                                     f"got {settings[f.name]!r}")
                values[f.name] = settings[f.name]
                continue
            cast = float if f.type == "float" else int
            try:
                values[f.name] = cast(settings[f.name])
            except (TypeError, ValueError):
                raise ValueError(f"tenant {name}: {f.name} must be a number, "
                                 f"got {settings[f.name]!r}") from None
    return Tenant(name=name, **values)


def _bind(keys: dict[str, str], digest: str, name: str) -> None:
    if keys.get(digest, name) != name:
        raise ValueError(f"one API key is given to two tenants ({keys[digest]} and {name})")
    keys[digest] = name
