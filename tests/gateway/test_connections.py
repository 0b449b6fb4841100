"""The gateway's client connections, probed with raw sockets against a real gateway process over
real workers: a request's headers and body must arrive in time however they trickle
(slowloris), open connections are capped below the open-file limit, a refused body closes the
connection instead of being read (gently: the client still reads the refusal), a client that leaves mid-upload is a client that
left (499), not a server error, JSON is the only body taken, and CORS is off unless asked."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from gateway_processes import admin_url


def _metric_sum(gateway, name: str, label: str) -> float:
    """The sum of `name`'s samples whose labels include `label` (e.g. 'reason="limit"')."""
    text = httpx.get(f"{admin_url(f'http://{gateway.address}')}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and label in line)


def _connect(gateway) -> socket.socket:
    host, port = gateway.address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def _closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the gateway closed `sock` (EOF or reset), None if it stayed open."""
    start = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - start


def _head(path: str, length: int, content_type: str = "application/json", extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {length}\r\n{extra}\r\n").encode()


def _response(sock: socket.socket) -> tuple[int, bytes]:
    """Status and raw bytes of one response (read until the gateway closes or 2 s pass)."""
    sock.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    sock.settimeout(2)
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        pass
    return int(data.split(b" ", 2)[1]), data


@pytest.fixture
def body(tiny_llama_dir) -> bytes:
    return json.dumps({"model": tiny_llama_dir.name, "prompt": "hello", "max_tokens": 2}).encode()


@pytest.fixture
def gateway(gateway_factory, disagg_workers):
    prefill, decode = disagg_workers
    return gateway_factory("--prefill", prefill.address, "--decode", decode.address,
                           "--request-read-timeout-s", "1.5", "--max-connections", "8",
                           "--keep-alive-timeout-s", "30")


def test_a_silent_or_trickling_client_is_closed_at_the_read_timeout(gateway):
    silent = _connect(gateway)
    trickling = _connect(gateway)
    start = time.monotonic()
    try:
        for byte in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n":
            trickling.send(bytes([byte]))
            time.sleep(0.1)  # a byte at a time resets no clock
            if time.monotonic() - start > 6:
                break
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert time.monotonic() - start < 4, "a trickle of header bytes held the connection"
    assert _closed_within(trickling, 3) is not None
    assert _closed_within(silent, 3) is not None
    assert _metric_sum(gateway, "splitserve_gateway_connections_closed_total",
                       'reason="header_timeout"') >= 2


def test_kept_alive_connections_and_slow_but_timely_headers_are_served(body, gateway):
    sock = _connect(gateway)
    with sock:
        for _ in range(2):
            request = _head("/v1/completions", len(body)) + body
            for part in (request[:20], request[20:60], request[60:]):
                sock.send(part)
                time.sleep(0.3)  # 0.9 s in all: within the 1.5 s bound
            status, data = _response(sock)
            assert status == 200, data[:300]
            time.sleep(2)  # idle longer than the read timeout: the keep-alive clock rules here


def test_a_body_that_does_not_arrive_in_time_is_408_and_closes(body, gateway):
    sock = _connect(gateway)
    with sock:
        sock.send(_head("/v1/completions", len(body)) + body[:10])
        status, data = _response(sock)
        assert status == 408, data[:300]
        assert b"request_body_timeout" in data and b"connection: close" in data.lower()
        assert _closed_within(sock, 3) is not None


def test_connections_over_the_limit_are_closed_at_once_and_service_goes_on(body, gateway_factory,
                                                                          disagg_workers):
    prefill, decode = disagg_workers
    gateway = gateway_factory("--prefill", prefill.address, "--decode", decode.address,
                              "--max-connections", "4")
    held = [_connect(gateway) for _ in range(4)]
    try:
        time.sleep(0.2)
        extra = _connect(gateway)
        assert _closed_within(extra, 3) is not None  # accepted, then closed
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.3)
    response = httpx.post(f"http://{gateway.address}/v1/completions", content=body,
                          headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 200, response.text
    assert _metric_sum(gateway, "splitserve_gateway_connections_closed_total",
                       'reason="limit"') >= 1


def test_a_body_over_the_limit_closes_the_connection_unread(body, gateway):
    sock = _connect(gateway)
    with sock:
        sock.send(_head("/v1/completions", 64 << 20, extra="Expect: 100-continue\r\n"))
        status, data = _response(sock)  # no body sent: it must not be waited for
        assert status == 413, data[:300]
        assert b"connection: close" in data.lower()
        assert _closed_within(sock, 3) is not None


def test_a_client_still_uploading_a_body_over_the_limit_reads_its_413(gateway_factory,
                                                                    disagg_workers):
    """The gateway answers 413 on the Content-Length and reads no more of the body, but it
    half-closes and drops what still comes instead of closing outright: a socket closed with
    unread data sends a reset, and the client, still sending, got that instead of the 413."""
    prefill, decode = disagg_workers
    gateway = gateway_factory("--prefill", prefill.address, "--decode", decode.address,
                              "--max-body-bytes", "64KiB")
    sock = _connect(gateway)
    with sock:
        sock.sendall(_head("/v1/completions", 8 << 20) + b"x" * (1 << 20))
        time.sleep(0.5)  # the 413 is out and the gateway is done with the request
        for _ in range(8):
            sock.sendall(b"x" * (256 << 10))  # the client goes on uploading
        status, data = _response(sock)
    assert status == 413, data[:300]
    assert b"request_too_large" in data
    time.sleep(0.3)
    assert httpx.get(f"http://{gateway.address}/health", timeout=10).status_code == 200


def test_a_client_that_leaves_mid_upload_is_counted_gone_not_an_error(body, gateway):
    errors = _metric_sum(gateway, "splitserve_gateway_requests_total", 'outcome="error"')
    sock = _connect(gateway)
    sock.send(_head("/v1/completions", len(body)) + body[:10])
    time.sleep(0.3)
    sock.close()
    time.sleep(0.5)
    assert _metric_sum(gateway, "splitserve_gateway_requests_total", 'outcome="error"') == errors
    assert _metric_sum(gateway, "splitserve_gateway_requests_total", 'outcome="cancelled"') >= 1
    assert "Traceback" not in gateway.output()
    assert "unexpected" not in gateway.output().lower()


@pytest.mark.parametrize(("headers", "message"), [
    ({"content-type": "text/plain"}, "Content-Type must be application/json"),
    ({"content-type": "application/x-www-form-urlencoded"}, "Content-Type must be application/json"),
    ({"content-type": "application/json", "content-encoding": "gzip"}, "Content-Encoding"),
])
def test_only_uncompressed_json_bodies_are_taken(body, gateway, headers, message):
    response = httpx.post(f"http://{gateway.address}/v1/completions", content=body,
                          headers=headers, timeout=30)
    assert response.status_code == 415, response.text
    assert message in response.json()["error"]["message"]
    assert response.json()["error"]["code"] == "unsupported_media_type"


@pytest.mark.parametrize("content_type", [None, "application/json; charset=utf-8"])
def test_json_with_or_without_a_content_type_is_served(body, gateway, content_type):
    headers = {"content-type": content_type} if content_type else {}
    response = httpx.post(f"http://{gateway.address}/v1/completions", content=body,
                          headers=headers, timeout=60)
    assert response.status_code == 200, response.text


def test_cors_is_off_unless_origins_are_allowed(body, gateway, gateway_factory, disagg_workers):
    preflight = {"origin": "https://app.example", "access-control-request-method": "POST",
                 "access-control-request-headers": "authorization,content-type"}
    response = httpx.options(f"http://{gateway.address}/v1/chat/completions", headers=preflight)
    assert "access-control-allow-origin" not in response.headers

    prefill, decode = disagg_workers
    allowing = gateway_factory("--prefill", prefill.address, "--decode", decode.address,
                               "--allowed-origins", "https://app.example")
    response = httpx.options(f"http://{allowing.address}/v1/chat/completions", headers=preflight)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == "https://app.example"
    served = httpx.post(f"http://{allowing.address}/v1/completions", content=body,
                        headers={"origin": "https://app.example",
                                 "content-type": "application/json"}, timeout=60)
    assert served.status_code == 200
    assert served.headers["access-control-allow-origin"] == "https://app.example"
    assert "x-request-id" in served.headers["access-control-expose-headers"].lower()
    other = httpx.options(f"http://{allowing.address}/v1/chat/completions",
                          headers={**preflight, "origin": "https://evil.example"})
    assert other.headers.get("access-control-allow-origin") != "https://evil.example"


def test_a_body_framed_two_ways_is_refused_and_the_connection_closed(body, gateway):
    sock = _connect(gateway)
    with sock:
        chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
        sock.send(_head("/v1/completions", len(body), extra="Transfer-Encoding: chunked\r\n")
                  + chunked)
        status, data = _response(sock)
        assert status == 400, data[:300]
        assert b"ambiguous_body_length" in data and b"connection: close" in data.lower()
        assert _closed_within(sock, 3) is not None


def test_bodies_being_received_together_are_bounded(body, gateway_factory, disagg_workers):
    prefill, decode = disagg_workers
    gateway = gateway_factory("--prefill", prefill.address, "--decode", decode.address,
                              "--max-body-bytes", "64KiB", "--max-buffered-body-bytes", "128KiB")
    held = [_connect(gateway) for _ in range(2)]
    try:
        for sock in held:  # 60 KiB of a 64 KiB body each, the rest never sent
            sock.send(_head("/v1/completions", 64 << 10) + b"x" * (60 << 10))
        time.sleep(0.5)
        third = _connect(gateway)
        with third:
            third.send(_head("/v1/completions", 64 << 10) + b"x" * (30 << 10))
            status, data = _response(third)
        assert status == 503, data[:300]
        assert b"retry-after" in data.lower() and b"connection: close" in data.lower()
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.5)  # the held bodies are released with their connections
    response = httpx.post(f"http://{gateway.address}/v1/completions", content=body,
                          headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 200, response.text
