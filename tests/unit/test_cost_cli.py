"""`splitserve cost` on an access log recorded from a real gateway (SmolLM2, one prefill and
one decode worker, tenants acme and globex; tests/unit/data/cost_access_log.jsonl)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from splitserve_cli.main import main

LOG = Path(__file__).parent / "data" / "cost_access_log.jsonl"
REPO_ROOT = Path(__file__).resolve().parents[2]
# $3.60 per worker-hour is $0.001 per worker-second: costs read as compute seconds / 1000.
PRICE = ["--price-per-hour", "H100=3.60"]
UNTIL = ["--until", "2026-12-01T18:33:14Z"]


def _entries() -> list[dict]:
    return [json.loads(line) for line in LOG.read_text().splitlines()]


def _compute(entries) -> float:
    return sum(sum(e["compute_seconds"].values()) for e in entries)


def _line(out: str, key: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(key))


def test_cost_prints_cost_per_request_per_1k_tokens_per_tenant_and_idle_share(capsys):
    assert main(["cost", str(LOG), *PRICE, "--since", "60s", *UNTIL]) == 0
    out = capsys.readouterr().out
    entries = _entries()
    compute = _compute(entries)
    tokens = sum(e["completion_tokens"] for e in entries)
    assert _line(out, "requests") == f"requests    12, {tokens} output tokens"
    assert f"total {compute:.3f}s" in _line(out, "compute")
    # Two workers named in the log, a 60 s window: 120 worker-seconds paid for.
    capacity = _line(out, "capacity")
    assert "120 worker-seconds" in capacity
    assert f"idle {1 - compute / 120:.1%}" in capacity
    assert f"${compute / 1000 / 12:.6f} charged" in _line(out, "per request")
    assert f"${compute / tokens:.6f} charged" in _line(out, "per 1k out")
    assert "$0.120000 with idle" in _line(out, "cost")
    rows = {line.split()[0]: line.split() for line in out.splitlines()[-2:]}
    acme = [e for e in entries if e["tenant"] == "acme"]
    assert rows["acme"][1:3] == [str(len(acme)), str(sum(e["completion_tokens"] for e in acme))]
    assert float(rows["acme"][3]) == pytest.approx(_compute(acme), abs=1e-3)
    assert rows["globex"][1] == "4"
    # The tenants' shares of the whole capacity's cost add up to it.
    assert sum(float(r[6].lstrip("$")) for r in rows.values()) == pytest.approx(0.12, abs=1e-5)


def test_since_keeps_only_the_window_and_workers_overrides_the_count(capsys):
    assert main(["cost", str(LOG), *PRICE, "--since", "3s", "--until", "2026-12-01T18:33:12Z",
                 "--workers", "4"]) == 0
    out = capsys.readouterr().out
    kept = [e for e in _entries() if e["ts"] <= "2026-12-01T18:33:12"]
    assert _line(out, "requests").startswith(f"requests    {len(kept)},")
    assert "12 worker-seconds" in _line(out, "capacity")
    assert f"total {_compute(kept):.3f}s" in _line(out, "compute")


def test_lines_that_are_not_access_records_are_skipped(tmp_path, capsys):
    mixed = tmp_path / "gateway.log"
    mixed.write_text("plain text line\n{not json\n"
                     + json.dumps({"logger": "splitserve.gateway", "ts": "2026-12-01T18:33:10Z"})
                     + "\n[1, 2]\n" + LOG.read_text())
    assert main(["cost", str(mixed), *PRICE, "--since", "60s", *UNTIL]) == 0
    assert _line(capsys.readouterr().out, "requests").startswith("requests    12,")


def test_lines_prefixed_by_splitserve_up_are_read(tmp_path, capsys):
    """`splitserve up` prefixes each line of its children with the service's name."""
    prefixed = tmp_path / "up.log"
    prefixed.write_text("[prefill] worker ready\n"
                        + "".join(f"[gateway] {line}\n" for line in LOG.read_text().splitlines()))
    assert main(["cost", str(prefixed), *PRICE, "--since", "60s", *UNTIL]) == 0
    out = capsys.readouterr().out
    assert _line(out, "requests").startswith("requests    12,")
    assert f"total {_compute(_entries()):.3f}s" in _line(out, "compute")


@pytest.mark.parametrize("args, message", [
    (["--price-per-hour", "H100"], "GPU=USD"),
    (["--price-per-hour", "H100=-1"], "GPU=USD"),
    (["--price-per-hour", "H100=2", "--since", "1 hour"], "duration"),
    (["--price-per-hour", "H100=2", "--until", "yesterday"], "ISO time"),
])
def test_bad_arguments_are_clear_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["cost", str(LOG), *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_missing_log_file_is_a_clear_error(tmp_path, capsys):
    assert main(["cost", str(tmp_path / "nope.log"), *PRICE]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_the_command_reads_stdin(capsys):
    result = subprocess.run(
        [sys.executable, "-m", "splitserve_cli.main", "cost", *PRICE, "--since", "1h", *UNTIL],
        input=LOG.read_text(), capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    assert _line(result.stdout, "requests").startswith("requests    12,")


def test_with_idle_is_never_below_charged_and_bad_figures_are_skipped(tmp_path, capsys):
    """A window shorter than the compute logged in it (requests that ran partly before it):
    busy was capped at 100% and "with idle" came out below "charged"; a line whose figures
    are not counts (text, negative) was a traceback, or a negative cost (a CLI audit)."""
    entries = _entries()
    bad = [dict(entries[0], completion_tokens="x"),
           dict(entries[0], compute_seconds={"prefill": "abc"}),
           dict(entries[0], compute_seconds={"prefill": -50.0})]
    log = tmp_path / "gateway.log"
    log.write_text("\n".join(json.dumps(e) for e in [*bad, *entries]) + "\n")
    assert main(["cost", str(log), *PRICE, "--since", "60s", *UNTIL, "--workers", "1",
                 "--since", "2s"]) == 0
    out = capsys.readouterr().out
    compute = _compute([e for e in entries if e["ts"] >= "2026-12-01T18:33:12"])
    assert compute > 2, "the window should hold more compute than its capacity"
    assert "exceeds the capacity" in _line(out, "note")
    charged, whole = (float(x.split()[0].lstrip("$"))
                      for x in _line(out, "cost")[12:].split(", "))
    assert whole >= charged
    assert main(["cost", str(log), *PRICE, "--since", "60s", *UNTIL]) == 0
    assert _line(capsys.readouterr().out, "requests").startswith("requests    12,")
