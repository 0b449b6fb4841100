"""The internal plane's settings fail at start-up with one clear line: TLS files all three or
none (never a quiet fallback to plaintext), PEM files that exist, a cluster secret long enough
to be a key; the worker and the gateway read the same SPLITSERVE_TLS_* variables."""

from __future__ import annotations

import argparse

import pytest

from services.common.security import TLSFiles, read_cluster_secret
from services.common.worker_cli import add_worker_arguments, worker_config_from_args
from services.gateway.config import GatewayConfig, add_gateway_arguments, gateway_config_from_args
from splitserve_cli.dev_certs import make_pki


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"), "cluster")


def test_tls_needs_all_three_files_that_exist_and_hold_pem(node, tmp_path):
    TLSFiles().check()
    TLSFiles(str(node.cert), str(node.key), str(node.ca)).check()
    with pytest.raises(ValueError, match="missing --tls-key, --tls-ca"):
        TLSFiles(cert=str(node.cert)).check()
    with pytest.raises(ValueError, match="--tls-ca '/nope' is not a file"):
        TLSFiles(str(node.cert), str(node.key), "/nope").check()
    (tmp_path / "der").write_bytes(b"\x30\x82")
    with pytest.raises(ValueError, match="not a PEM file"):
        TLSFiles(str(node.cert), str(tmp_path / "der"), str(node.ca)).check()


def test_cluster_secret_is_read_stripped_and_must_be_long_enough(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(b"  0123456789abcdef0123\n")
    assert read_cluster_secret(str(path)) == b"0123456789abcdef0123"
    path.write_bytes(b"short\n")
    with pytest.raises(ValueError, match="holds 5 bytes; use at least 16"):
        read_cluster_secret(str(path))
    with pytest.raises(ValueError, match="--cluster-secret-file '/nope'"):
        read_cluster_secret("/nope")


def test_worker_and_gateway_read_the_same_tls_environment(node, tiny_llama_dir, monkeypatch):
    for name, value in node.env().items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, "decode")
    worker = worker_config_from_args(parser.parse_args(["--model", str(tiny_llama_dir)]), "decode")
    assert worker.tls == TLSFiles(str(node.cert), str(node.key), str(node.ca))
    parser = argparse.ArgumentParser()
    add_gateway_arguments(parser)
    gateway = gateway_config_from_args(parser.parse_args(
        ["--model", str(tiny_llama_dir), "--worker", "a:1", "--grpc-client-certs"]))
    assert gateway.tls == worker.tls and gateway.grpc_client_certs


def test_bad_security_settings_stop_the_worker_with_one_line(node, tiny_llama_dir):
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, "decode")
    args = parser.parse_args(["--model", str(tiny_llama_dir), "--tls-cert", str(node.cert)])
    with pytest.raises(SystemExit, match="splitserve worker: TLS needs"):
        worker_config_from_args(args, "decode")


def test_front_door_client_certificates_need_tls(tiny_llama_dir):
    with pytest.raises(ValueError, match="--grpc-client-certs needs"):
        GatewayConfig(model=str(tiny_llama_dir), worker=("a:1",), grpc_client_certs=True)


def test_make_pki_takes_its_folder_as_a_string_too(tmp_path):
    """As the README shows it, `make_pki(folder, name).env()`: a str folder was an
    AttributeError ('str' object has no attribute 'mkdir'; a README audit)."""
    env = make_pki(str(tmp_path / "pki"), "cluster").env()
    assert env and all(value.startswith(str(tmp_path / "pki")) for value in env.values()
                       if value.endswith(".pem"))
