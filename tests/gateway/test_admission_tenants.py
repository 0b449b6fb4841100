"""Tenants: the YAML file and the key secret become a directory of tenants keyed by SHA-256
digests of API keys; no file and no keys means one anonymous tenant and no authentication."""

from __future__ import annotations

import hashlib

import pytest

from services.gateway.admission.tenants import ANONYMOUS, key_digest, load_tenants
from services.gateway.errors import APIError

TENANTS_YAML = """
defaults:
  max_queued: 50
tenants:
  acme:
    api_key_sha256: {acme}
    weight: 2
    priority: 1
    tokens_per_minute: 200000
    burst_tokens: 20000
    max_concurrency: 64
    max_prompt_tokens: 4096
    max_output_tokens: 512
  free:
    weight: 1
    tokens_per_minute: 20000
    max_queued: 5
"""


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    return str(path)


def test_no_tenants_file_and_no_keys_is_one_anonymous_tenant_without_auth():
    directory = load_tenants()
    assert not directory.auth_enabled
    assert directory.authenticate(None).name == ANONYMOUS
    assert directory.authenticate("Bearer whatever").name == ANONYMOUS
    assert list(directory.tenants) == [ANONYMOUS]


def test_file_and_secret_bind_keys_to_tenants_with_their_settings(tmp_path):
    path = _write(tmp_path, TENANTS_YAML.format(acme=key_digest("sk-acme")))
    directory = load_tenants(path, ["free:sk-free-1", "free:sk-free-2"])
    acme = directory.authenticate("Bearer sk-acme")
    assert (acme.name, acme.weight, acme.priority, acme.tokens_per_minute, acme.bucket_size,
            acme.max_concurrency, acme.max_prompt_tokens, acme.max_output_tokens,
            acme.max_queued) == ("acme", 2.0, 1, 200000, 20000, 64, 4096, 512, 50)
    free = directory.authenticate("bearer  sk-free-2 ")
    assert (free.name, free.bucket_size, free.max_queued) == ("free", 20000, 5)
    assert directory.authenticate("Bearer sk-free-1") is free


def test_keys_are_kept_only_as_digests(tmp_path):
    path = _write(tmp_path, TENANTS_YAML.format(acme=key_digest("sk-acme")))
    directory = load_tenants(path, ["free:sk-free-1"])
    assert hashlib.sha256(b"sk-free-1").hexdigest() in directory._keys
    assert not any("sk-" in k for k in directory._keys)


@pytest.mark.parametrize("authorization", [None, "", "Bearer", "Bearer nope", "Basic sk-acme",
                                           "sk-acme"])
def test_a_missing_or_wrong_key_is_401(tmp_path, authorization):
    path = _write(tmp_path, TENANTS_YAML.format(acme=key_digest("sk-acme")))
    directory = load_tenants(path)
    with pytest.raises(APIError) as refused:
        directory.authenticate(authorization)
    assert refused.value.status == 401 and refused.value.code == "invalid_api_key"


def test_bare_keys_are_tenants_of_their_own_with_the_flag_defaults():
    directory = load_tenants("", ["key-a", "key-b"], defaults={"max_concurrency": 1})
    a, b = directory.authenticate("Bearer key-a"), directory.authenticate("Bearer key-b")
    assert a.name != b.name and a.max_concurrency == b.max_concurrency == 1
    assert a.name == f"key-{key_digest('key-a')[:12]}"


DIGEST = "ab" * 32


@pytest.mark.parametrize(("text", "message"), [
    (f"tenants:\n  a: {{weigth: 2, api_key_sha256: {DIGEST}}}\n", "unknown settings"),
    ("tenants:\n  a: {api_key_sha256: abc}\n", "not a SHA-256"),
    (f"tenants:\n  a: {{weight: 0, api_key_sha256: {DIGEST}}}\n", "weight must be > 0"),
    (f"tenants:\n  a: {{tokens_per_minute: lots, api_key_sha256: {DIGEST}}}\n",
     "must be a number"),
    ("tenants:\n  a: {weight: 1}\n", "no API key reaches"),
    (f"tenants:\n  a: {{api_key_sha256: {DIGEST}}}\n  b: {{api_key_sha256: {DIGEST}}}\n",
     "two tenants"),
    ("tenant:\n  a: {}\n", "unknown top-level"),
    ("tenants: [\n", "not valid YAML"),
    (f"tenants:\n  a: {{api_key_sha256: {'1' * 64}}}\n", "quoted"),
])
def test_tenants_file_mistakes_are_clear_errors(tmp_path, text, message):
    with pytest.raises(ValueError, match=message):
        load_tenants(_write(tmp_path, text))
