"""bench/fairness.py's arithmetic: served-token shares, TTFT percentiles, reject rates and
goodput per tenant, and the tenants file it writes."""

from __future__ import annotations

import pytest

from bench.fairness import TenantLoad, summarize, table, tenants_yaml
from bench.loadgen.metrics import RequestRecord
from services.gateway.admission.tenants import load_tenants


def _record(tenant: str, status: str = "ok", ttft: float | None = 0.1, prompt: int = 10,
            output: int = 5) -> RequestRecord:
    return RequestRecord(index=0, cls=tenant, tenant=tenant, prompt_len=prompt, output_len=output,
                         start_s=0.0, status=status, ttft_s=ttft if status == "ok" else None,
                         output_tokens=output if status == "ok" else 0)


def test_summary_counts_served_tokens_shares_refusals_and_goodput():
    records = ([_record("long", prompt=90, output=10)] * 3
               + [_record("long", "http_503")] * 2
               + [_record("short", ttft=0.05)] * 9 + [_record("short", ttft=2.0)]
               + [_record("short", "http_429"), _record("short", "timeout")])
    results = summarize(records, duration_s=2.0, ttft_target_s=1.0)
    long, short = results["long"], results["short"]
    assert (long.sent, long.served, long.rejected, long.failed) == (5, 3, 2, 0)
    assert (short.sent, short.served, short.rejected, short.failed) == (12, 10, 1, 1)
    assert long.served_tokens == 300 and short.served_tokens == 150
    assert long.token_share == pytest.approx(2 / 3)
    assert long.reject_rate == pytest.approx(0.4)
    assert short.goodput_rps == pytest.approx(4.5)  # 9 within the target, over 2 s
    assert "| vtc | short | 33% |" in table({"vtc": results})


def test_the_tenants_file_it_writes_binds_each_tenants_key(tmp_path):
    loads = [TenantLoad("long", 1, 10, 5, weight=2), TenantLoad("short", 1, 10, 5)]
    path = tmp_path / "tenants.yaml"
    path.write_text(tenants_yaml(loads, max_queued=7))
    directory = load_tenants(str(path))
    tenant = directory.authenticate(f"Bearer {loads[0].api_key}")
    assert (tenant.name, tenant.weight, tenant.max_queued) == ("long", 2.0, 7)
