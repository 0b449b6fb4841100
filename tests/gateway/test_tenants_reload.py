"""Tenants and API keys changed without a restart: a real gateway re-reads its tenants file and
API-keys file when they change (or on SIGHUP), keeps serving on the last good ones when a
change does not load, and never lets an emptied key file turn authentication off."""

from __future__ import annotations

import signal
import time

import httpx
import pytest
from tenant_load import metric, tenants_file

from services.gateway.admission.config import read_api_keys_file
from services.gateway.admission.tenants import load_tenants
from services.gateway.admission.tenants_watch import TenantsWatcher
from services.gateway.errors import APIError


def _status(gateway, key: str, model: str, max_tokens: int = 4) -> tuple[int, int]:
    """(HTTP status, completion tokens) of a small completion with `key`."""
    response = httpx.post(f"http://{gateway.address}/v1/completions", timeout=60,
                          headers={"Authorization": f"Bearer {key}"},
                          json={"model": model, "prompt": [40, 41, 42], "max_tokens": max_tokens,
                                "ignore_eos": True})
    tokens = response.json()["usage"]["completion_tokens"] if response.status_code == 200 else 0
    return response.status_code, tokens


def _until(check, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (result := check()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return result


def test_a_rotated_key_and_an_edited_quota_apply_without_a_restart(
        gateway_factory, disagg_workers, tiny_llama_dir, tmp_path):
    prefill, decode = disagg_workers
    tenants = tenants_file(tmp_path, {"acme": {"max_output_tokens": 8}})
    keys = tmp_path / "api-keys"
    keys.write_text("# rotated monthly\nacme:sk-old\n")
    gateway = gateway_factory("--prefill", prefill.address, "--decode", decode.address,
                              "--tenants-file", tenants, "--api-keys-file", str(keys),
                              "--tenants-reload-s", "0.2")
    model = tiny_llama_dir.name
    url = f"http://{gateway.address}"
    assert _status(gateway, "sk-old", model) == (200, 4)
    assert _status(gateway, "sk-new", model)[0] == 401

    keys.write_text("acme:sk-new\n")
    assert _until(lambda: _status(gateway, "sk-new", model)[0] == 200)
    assert _status(gateway, "sk-old", model)[0] == 401
    assert _status(gateway, "sk-acme", model) == (200, 4)  # the tenants file's own key

    tenants_file(tmp_path, {"acme": {"max_output_tokens": 2}})
    assert _until(lambda: _status(gateway, "sk-acme", model) == (200, 2))
    ok = metric(url, "splitserve_gateway_tenants_reloads_total", 'result="ok"')
    assert ok >= 2

    # A file that does not load leaves the last good directory in use, logged and counted.
    (tmp_path / "tenants.yaml").write_text("tenants: [unclosed\n")
    assert _until(lambda: metric(url, "splitserve_gateway_tenants_reloads_total",
                                 'result="error"') == 1)
    assert _status(gateway, "sk-acme", model) == (200, 2)
    assert _status(gateway, "sk-new", model) == (200, 2)
    assert "tenants not reloaded" in gateway.output()
    assert gateway.alive()


def test_with_polling_off_sighup_reloads(gateway_factory, disagg_workers, tiny_llama_dir,
                                         tmp_path):
    prefill, decode = disagg_workers
    keys = tmp_path / "api-keys"
    keys.write_text("sk-first")
    gateway = gateway_factory("--prefill", prefill.address, "--decode", decode.address,
                              "--api-keys-file", str(keys), "--tenants-reload-s", "0")
    model = tiny_llama_dir.name
    keys.write_text("sk-first,sk-second")
    time.sleep(1.0)
    assert _status(gateway, "sk-second", model)[0] == 401  # not polled
    gateway.process.send_signal(signal.SIGHUP)
    assert _until(lambda: _status(gateway, "sk-second", model)[0] == 200)
    assert _status(gateway, "sk-first", model)[0] == 200


class _Admission:
    def __init__(self, directory) -> None:
        self.directory = directory


def test_an_emptied_key_file_never_turns_authentication_off(tmp_path):
    from prometheus_client import CollectorRegistry

    keys = tmp_path / "api-keys"
    keys.write_text("sk-a\nsk-b\n")
    build = lambda: load_tenants("", read_api_keys_file(str(keys)))  # noqa: E731
    admission = _Admission(build())
    watcher = TenantsWatcher(admission, build, [str(keys)], 0, CollectorRegistry())
    keys.write_text("# all keys revoked\n")
    assert not watcher.reload()
    assert admission.directory.auth_enabled
    assert admission.directory.authenticate("Bearer sk-a").name.startswith("key-")
    keys.write_text("sk-b\n")  # one key revoked, one kept: fine
    assert watcher.reload()
    with pytest.raises(APIError) as refused:
        admission.directory.authenticate("Bearer sk-a")
    assert refused.value.status == 401


def test_an_empty_key_file_is_refused_at_start(tmp_path, tiny_llama_dir):
    from services.gateway.config import GatewayConfig

    keys = tmp_path / "api-keys"
    keys.write_text("\n# nothing yet\n")
    with pytest.raises(ValueError, match="holds no key"):
        GatewayConfig(model=str(tiny_llama_dir), worker=("127.0.0.1:1",),
                      api_keys_file=str(keys))
    with pytest.raises(ValueError, match="does not exist"):
        GatewayConfig(model=str(tiny_llama_dir), worker=("127.0.0.1:1",),
                      api_keys_file=str(tmp_path / "missing"))
