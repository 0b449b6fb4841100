"""The gateway's one typed configuration object, from CLI flags and SPLITSERVE_GATEWAY_* env
(SPLITSERVE_MODEL for the model folder, shared with the workers)."""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import asdict, dataclass, fields

from services.common.addresses import check_port

DEFAULT_MODEL = "models/smollm2-135m-instruct"
_SIZE = re.compile(r"^\s*(\d+)\s*(|B|KiB|MiB|GiB|KB|MB|GB|K|M|G)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "k": 10**3, "m": 10**6, "g": 10**9}


def parse_size(text: str) -> int:
    """'8MiB' -> 8388608, '64KiB' -> 65536, '1000' -> 1000. (Not services.common's: that
    module imports the engine, and the gateway must not import torch.)"""
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"cannot read {text!r} as a size (examples: 64KiB, 8MiB, 1000000)")
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


@dataclass(frozen=True)
class GatewayConfig:
    model: str = DEFAULT_MODEL  # folder with tokenizer.json (the weights are not loaded)
    served_model_name: str = ""  # default: the folder's name, as the workers report it
    prefill: tuple[str, ...] = ()  # disaggregated: prefill workers ...
    decode: tuple[str, ...] = ()  # ... and decode workers
    worker: tuple[str, ...] = ()  # aggregated: role-both workers
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = -1  # gRPC front door: -1 off, 0 any free port
    # /metrics, /ready (it lists worker addresses) and /openapi.json: never on the public port.
    admin_host: str = "127.0.0.1"
    admin_port: int = 0  # 0: --port + 1 (any free port when --port is 0), -1: off
    health_interval_s: float = 1.0
    prefill_timeout_s: float = 120.0
    # Moves of a stream whose decode worker failed or drained after tokens were sent: another
    # worker recomputes prompt + tokens so far and the stream goes on unchanged (0: off, the
    # stream ends with an error event). At most 9 (request ids carry "-moveN").
    migration_limit: int = 3
    # How long a broken stream waits for a decode worker to move to before ending in an error.
    migration_wait_s: float = 10.0
    max_body_bytes: int = 8 << 20
    # Bodies being received, all requests together: a flood of slow uploads cannot fill memory.
    max_buffered_body_bytes: int = 256 << 20
    # Edge limits (services/gateway/api/request_limits.py): over one -> 400, before tokenizing.
    max_prompts_per_request: int = 1024  # strings/token lists in a completions `prompt` list
    max_choices_per_request: int = 1024  # prompts x n: the worker requests one request opens
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 256
    max_request_id_length: int = 128  # x-request-id / gRPC request_id characters
    tokenizer_threads: int = 2  # chat templates and tokenization run here, off the event loop
    tool_call_parser: str = "hermes"  # tool-call format (api/tool_parsers); none: tools refused
    # Build the grammar tokenizer at start, in a tokenizer thread (54 MiB on SmolLM2), not on
    # the first request under a structured output (about 0.3 s of its first token).
    structured_outputs_warmup: bool = True
    # Time bounds (services/gateway/api/deadline.py); 0: none.
    request_timeout_s: float = 600.0  # arrival to last token; a caller may lower it
    stall_timeout_s: float = 90.0  # no token for this long after the first -> error, aborted
    stream_buffer_chunks: int = 64  # SSE chunks buffered per response before backpressure
    slow_client_timeout_s: float = 30.0  # a write blocked this long cuts the client off
    max_inflight: int = 0  # requests released to workers by this gateway (0: no limit); more wait
    max_inflight_per_key: int = 0  # default max_concurrency of every tenant (0: no limit) -> 429
    api_keys: tuple[str, ...] = ()  # the key secret: `tenant:key` or a bare key (its own tenant)
    api_keys_file: str = ""  # more such entries, one per line or comma-separated; reloaded
    socket_send_buffer: int = 0  # SO_SNDBUF of client connections (0: the OS default)
    # Client connections (services/gateway/api/connections.py); 0: none / automatic.
    request_read_timeout_s: float = 60.0  # a request's headers, then its body, each within this
    keep_alive_timeout_s: float = 5.0  # an idle kept-alive connection is closed after this
    max_connections: int = 0  # open client connections (0: the open-file limit less a reserve)
    allowed_origins: tuple[str, ...] = ()  # CORS: browser origins that may call the API (*: any)
    shutdown_grace_s: float = 10.0
    log_level: str = "INFO"
    log_format: str = "json"  # json | text
    log_prompts: bool = False  # debug: prompt text in the access log
    # Routing (services/gateway/routing/router.py). With a Redis URL, workers are discovered from the
    # registry (on top of any given by address) and prefix-cache events are followed.
    redis_url: str = ""
    registry_interval_s: float = 0.5
    routing: str = "scored"  # scored | round_robin
    decode_scorers: str = "free_kv=1,running_load=1"
    prefill_scorers: str = "prefix_cache=1,queued_prefill=1"
    local_prefill_tokens: int = 0  # uncached prompt part this short is prefilled on decode (0: off)
    prefill_backlog_tokens: int = 8192  # all prefill workers this backed up -> decode prefills (0: off)
    decode_affinity_slack: int = 4  # extra load a decode worker holding the prompt may carry (<0: off)
    breaker_failures: int = 3  # consecutive RPC failures that take a worker out of rotation
    breaker_open_s: float = 2.0  # before a trial request probes it again
    # Admission (services/gateway/admission/admission.py): tenants, quotas (shared via redis_url),
    # fair queueing, the capacity rule for releasing queued requests, early rejection.
    tenants_file: str = ""  # YAML; empty: no tenants file
    # The tenants and API-keys files are re-read when they change (0: only on SIGHUP).
    tenants_reload_s: float = 10.0
    quota_fail_mode: str = "open"  # Redis unreachable: open (local limits) | closed (503)
    fairness: str = "vtc"  # vtc | round_robin | fcfs
    # No API keys: each client address a share of the fair queue (client), or all one (none).
    anonymous_fairness: str = "client"
    forwarded_allow_ips: tuple[str, ...] = ()  # proxies whose X-Forwarded-For names the client
    output_token_weight: float = 2.0  # an output token's cost in the virtual token counter
    ttft_target_s: float = 1.0  # predicted or waited past it -> 503 (0: off)
    tpot_target_s: float = 0.1  # a decode worker's streams slower than this take no more (0: off)
    max_inflight_per_decode: int = 0  # released requests per routable decode worker (0: its max_running)
    kv_headroom: float = 0.0  # fraction of decode KV blocks kept free when releasing
    max_prefill_queue_tokens: int = 0  # queued prompt tokens per prefill worker (0: no limit)
    # Internal plane (services/common/security.py): mutual TLS to the workers and on the gRPC
    # front door, and the secret registry entries must be signed with.
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    tls_server_name: str = ""  # the name workers' certificates carry (default: the dialed host)
    grpc_client_certs: bool = False  # front door: callers need a certificate from --tls-ca
    cluster_secret_file: str = ""

    def __post_init__(self) -> None:
        if not os.path.isfile(os.path.join(self.model, "tokenizer.json")):
            raise ValueError(f"--model {self.model!r} has no tokenizer.json")
        if self.worker and (self.prefill or self.decode):
            raise ValueError("use --worker (aggregated) or --prefill and --decode, not both")
        if not self.redis_url and not self.worker and not (self.prefill and self.decode):
            raise ValueError("give --redis-url URL, or --prefill ADDR and --decode ADDR, or "
                             "--worker ADDR")
        # Imported here so that reading this module (`splitserve gateway --help`,
        # bench/run_settings.py) costs none of the parts' imports. One way only: the parts read
        # their settings through Protocols (RoutingSettings, AdmissionSettings), not this module.
        from services.gateway.routing.config import validate_routing

        validate_routing(self)
        from services.gateway.admission.config import validate_admission

        validate_admission(self)
        from services.gateway.api.request_limits import validate_limits

        validate_limits(self)
        from services.gateway.api.client_address import ClientAddresses

        ClientAddresses(self.forwarded_allow_ips)
        if self.anonymous_fairness not in ("client", "none"):
            raise ValueError("--anonymous-fairness must be client or none")
        for name in ("health_interval_s", "prefill_timeout_s", "slow_client_timeout_s",
                     "keep_alive_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        if self.max_buffered_body_bytes < self.max_body_bytes:
            raise ValueError("--max-buffered-body-bytes must be at least --max-body-bytes")
        for name in ("request_read_timeout_s", "max_connections"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (0: "
                                 f"{'none' if name.endswith('_s') else 'automatic'})")
        if not 0 <= self.migration_limit <= 9:
            raise ValueError("--migration-limit must be in [0, 9]")
        if not 0 <= self.migration_wait_s <= 600:
            raise ValueError("--migration-wait-s must be in [0, 600]")
        from services.gateway.api.tool_parsers import tool_format

        tool_format(self.tool_call_parser)
        if self.log_format not in ("json", "text"):
            raise ValueError("--log-format must be json or text")
        if self.stream_buffer_chunks < 1:
            raise ValueError("--stream-buffer-chunks must be >= 1")
        check_port("--port", self.port)
        check_port("--grpc-port", self.grpc_port, off=True)
        if not -1 <= self.admin_port <= 65535 or self.admin_listen_port > 65535:
            raise ValueError("--admin-port must be a port, 0 (--port + 1) or -1 (off)")
        if self.admin_listen_port == self.port != 0 and self.admin_host == self.host:
            raise ValueError("--admin-port must differ from --port: /metrics and /ready are "
                             "never served on the public port")
        from services.common.security import read_cluster_secret

        self.tls.check()
        if self.grpc_client_certs and not self.tls.enabled:
            raise ValueError("--grpc-client-certs needs --tls-cert, --tls-key and --tls-ca")
        if self.cluster_secret_file:
            read_cluster_secret(self.cluster_secret_file)

    @property
    def tls(self):
        from services.common.security import TLSFiles

        return TLSFiles(self.tls_cert, self.tls_key, self.tls_ca, self.tls_server_name)

    @property
    def admin_listen_port(self) -> int:
        """The admin port to bind (-1: none): --port + 1 unless told, any free one with 0."""
        if self.admin_port:
            return self.admin_port
        return self.port + 1 if self.port else 0

    @property
    def model_name(self) -> str:
        return self.served_model_name or os.path.basename(os.path.normpath(self.model))

    @property
    def disaggregated(self) -> bool:
        return not self.worker

    def describe(self) -> str:
        values = asdict(self)
        values["api_keys"] = f"<{len(self.api_keys)} keys>"
        values["redis_url"] = re.sub(r"//[^@/]*@", "//<credentials>@", self.redis_url)
        return " ".join(f"{k}={v}" for k, v in values.items())


_ENV_NAMES = {"model": "SPLITSERVE_MODEL", "redis_url": "REDIS_URL",
              "tenants_file": "SPLITSERVE_TENANTS_FILE", "tls_cert": "SPLITSERVE_TLS_CERT",
              "tls_key": "SPLITSERVE_TLS_KEY", "tls_ca": "SPLITSERVE_TLS_CA",
              "tls_server_name": "SPLITSERVE_TLS_SERVER_NAME",
              "cluster_secret_file": "SPLITSERVE_CLUSTER_SECRET_FILE"}


def _env_name(field_name: str) -> str:
    return _ENV_NAMES.get(field_name, f"SPLITSERVE_GATEWAY_{field_name.upper()}")


def add_gateway_arguments(parser: argparse.ArgumentParser) -> None:
    """A flag per GatewayConfig field; each defaults to its environment variable if set."""
    helps = {
        "prefill": "prefill worker addresses, comma-separated (host:port,...)",
        "decode": "decode worker addresses, comma-separated",
        "worker": "aggregated (role both) worker addresses, comma-separated",
        "grpc_port": "gRPC front door port (-1: off, 0: any free port)",
        "admin_host": "address of the admin port (127.0.0.1: this machine only)",
        "admin_port": "admin port with /metrics, /ready, /health and /openapi.json, kept off "
                      "the public port (0: --port + 1, or any free port when --port is 0; "
                      "-1: off)",
        "max_body_bytes": "largest request body (e.g. 8MiB)",
        "max_buffered_body_bytes": "request bodies being received, all requests together; "
                                   "one that would go over is refused with 503 (e.g. 256MiB; "
                                   "at least --max-body-bytes)",
        "migration_limit": "moves of a stream whose decode worker failed or drained after "
                           "tokens were sent; it continues unchanged on another worker (0: off)",
        "migration_wait_s": "how long such a stream waits for a decode worker to move to (one "
                            "restarting, one just back) before it ends with an error event",
        "api_keys": "API keys, comma-separated: tenant:key, or a bare key that is its own "
                    "tenant (none and no tenants file: no authentication)",
        "api_keys_file": "a file of more API keys, as --api-keys takes them, one per line "
                         "or comma-separated (# comments); re-read when it changes",
        "tenants_file": "tenants YAML (weights, priorities, quotas; see README); re-read "
                        "when it changes",
        "tenants_reload_s": "how often the tenants and API-keys files are checked for "
                            "changes, which take effect without a restart (0: only on SIGHUP)",
        "anonymous_fairness": "with no API keys, client: each client address (an IPv6 "
                              "client's /64) is a share of the fair queue of its own, as a "
                              "tenant would be; none: all clients are one share",
        "forwarded_allow_ips": "proxies (addresses or CIDR networks, comma-separated, or *) "
                               "whose X-Forwarded-For header names the client; other peers' "
                               "is ignored (empty: the connection's peer is the client)",
        "redis_url": "discover workers (and follow their prefix caches) in this Redis",
        "routing": "scored (the scorers below) or round_robin (a baseline)",
        "decode_scorers": "name=weight,... of free_kv, running_load, prefix_cache, queued_prefill",
        "prefill_scorers": "name=weight,... (same scorers)",
        "decode_affinity_slack": "a decode worker holding most of the prompt takes it while "
                                 "at most this many requests (or as many as its least loaded "
                                 "peer has) above that peer (negative: off)",
        "local_prefill_tokens": "prefill on the decode worker when at most this much of the "
                                "prompt is uncached there (0: off)",
        "tpot_target_s": "hold new requests back from a decode worker whose running streams "
                         "get a token slower than this (their time per output token), until "
                         "its pace is back; they wait in the fair queue, under the TTFT "
                         "target (0: off)",
        "prefill_backlog_tokens": "prefill on the decode worker when every prefill worker has "
                                  "this many tokens queued, or none is up (0: off)",
        "max_prompts_per_request": "most prompts in one /v1/completions `prompt` list (400 over)",
        "max_choices_per_request": "most completions one request asks for, prompts x n (400 over)",
        "max_stop_strings": "most `stop` strings per request (400 over)",
        "max_stop_string_chars": "longest `stop` string in characters (400 over)",
        "max_stop_token_ids": "most `stop_token_ids` per request (400 over)",
        "max_request_id_length": "longest x-request-id / gRPC request_id (400 over)",
        "tokenizer_threads": "threads that apply chat templates and tokenize, off the event loop",
        "request_timeout_s": "a request's deadline from arrival, queue included (0: none); a "
                             "caller may lower it with the x-request-timeout-s header or a "
                             "gRPC deadline; past it: 504, or an error event mid-stream",
        "stall_timeout_s": "a stream that gets no token for this long after its first ends "
                           "with an error and is aborted on the workers (0: never)",
        "tool_call_parser": "how tool calls are written and parsed: hermes (<tool_call> JSON, "
                            "Hermes/Qwen/SmolLM2) or none (requests with tools are refused)",
        "structured_outputs_warmup": "build the grammar tokenizer at start, in a tokenizer "
                                     "thread, not on the first request under a structured "
                                     "output (true/false)",
        "request_read_timeout_s": "a request's headers must arrive within this of the "
                                  "connection opening (or of their first byte on a kept-alive "
                                  "connection), and its body within this after them; else the "
                                  "connection is closed / 408 (0: none)",
        "keep_alive_timeout_s": "close a kept-alive client connection idle this long; behind "
                                "a proxy or load balancer, set it above the proxy's idle timeout",
        "max_connections": "most client connections open at once; one more is closed when "
                           "accepted (0: the open-file limit, raised to its maximum at start, "
                           "less a reserve)",
        "allowed_origins": "CORS: browser origins allowed to call the API, comma-separated, "
                           "or * for any (empty: no CORS headers; browsers then refuse "
                           "cross-origin reads)",
        "log_format": "json (one object per line) or text",
        "log_prompts": "debug: write prompt text into the access log (true/false)",
        "tls_cert": "PEM certificate chain; with --tls-key and --tls-ca, mutual TLS to the "
                    "workers and TLS on the gRPC front door",
        "tls_ca": "PEM CA bundle workers' (and front-door callers') certificates must chain to",
        "tls_server_name": "name checked in workers' certificates instead of their address",
        "grpc_client_certs": "gRPC front door: refuse callers without a certificate from "
                             "--tls-ca (true/false)",
        "cluster_secret_file": "ignore registry entries and prefix events not signed with "
                               "the secret in this file",
    }
    for f in fields(GatewayConfig):
        flag = "--" + f.name.replace("_", "-")
        default = os.environ.get(_env_name(f.name))
        more = {"nargs": "?", "const": "true"} if f.type == "bool" else {}
        parser.add_argument(flag, default=default, metavar=f.name.upper(), **more,
                            help=f"{helps.get(f.name, '')} (env {_env_name(f.name)}; "
                                 f"default {f.default!r})".strip())


def _parse_bool(name: str, raw) -> bool:
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"--{name.replace('_', '-')}: expected true or false, got {raw!r}")


def gateway_config_from_args(args: argparse.Namespace) -> GatewayConfig:
    values = {}
    for f in fields(GatewayConfig):
        raw = getattr(args, f.name)
        if raw is None:
            continue
        if f.name in ("max_body_bytes", "max_buffered_body_bytes"):
            values[f.name] = parse_size(raw)
        elif f.type == "tuple[str, ...]":
            values[f.name] = tuple(a.strip() for a in str(raw).split(",") if a.strip())
        elif f.type == "int":
            values[f.name] = int(raw)
        elif f.type == "float":
            values[f.name] = float(raw)
        elif f.type == "bool":
            values[f.name] = _parse_bool(f.name, raw)
        else:
            values[f.name] = str(raw)
    return GatewayConfig(**values)
