"""The JSON log formatter writes every field the gateway's access log passes: its fields are a
fixed list (a LogRecord carries dozens of attributes), so a field added to the access log but
not to the list would vanish from every JSON log line (migrations did)."""

from __future__ import annotations

import ast
import json
import logging
from pathlib import Path

from services.common.logs import _EXTRA_FIELDS, JsonFormatter

REPO = Path(__file__).resolve().parents[2]


def _access_log_fields() -> set[str]:
    """The keys of the `fields` dict the access-log line is written with."""
    tree = ast.parse((REPO / "services/gateway/request_record.py").read_text())
    keys: set[str] = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                and any(isinstance(t, ast.Name) and t.id == "fields" for t in node.targets)):
            keys |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    return keys


def test_every_access_log_field_is_written():
    fields = _access_log_fields()
    assert {"request_id", "migrations", "compute_seconds"} <= fields  # found the right dict
    assert fields <= set(_EXTRA_FIELDS), sorted(fields - set(_EXTRA_FIELDS))


def test_a_migrated_request_keeps_its_moves_in_the_json_line():
    record = logging.makeLogRecord({"name": "splitserve.access", "levelno": logging.INFO,
                                    "levelname": "INFO", "msg": "http r1 200",
                                    "migrations": 2, "migration_reasons": "worker_failed,draining"})
    entry = json.loads(JsonFormatter("gateway").format(record))
    assert entry["migrations"] == 2 and entry["migration_reasons"] == "worker_failed,draining"
