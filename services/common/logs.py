"""Process logging: JSON lines (timestamp, level, service, message, and request_id / tenant
when the record carries them) or plain text for humans. Prompt text is never logged unless
the caller opts in with a debug flag."""

from __future__ import annotations

import json
import logging
import sys
import time

_EXTRA_FIELDS = ("request_id", "tenant", "client", "worker_id", "api", "endpoint", "outcome", "reason", "status",
                 "queue_s", "ttft_s", "e2e_s", "prompt_tokens", "completion_tokens",
                 "cached_tokens", "decode_worker", "prefill_worker", "route", "trace_id",
                 "prompt", "compute_seconds", "migrations", "migration_reasons")


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for field in _EXTRA_FIELDS:
            value = getattr(record, field, None)
            if value is not None:
                entry[field] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(service: str, level: str = "INFO", fmt: str = "json") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(logging.Formatter(
            f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
