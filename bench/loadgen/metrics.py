"""Per-request timings and the run summary: throughput, latency percentiles, goodput, errors.

Definitions (seconds):
  ttft  send -> first streamed content chunk
  itl   every gap between consecutive content chunks (one token each on servers that stream
        token by token; a chunk carrying several tokens gives one gap)
  tpot  (e2e - ttft) / (output_tokens - 1): the mean time per output token after the first
  e2e   send -> end of stream
Goodput counts completed requests meeting both the TTFT and the TPOT target, per second of run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class RequestRecord:
    index: int
    cls: str
    tenant: str
    prompt_len: int  # requested prompt tokens
    output_len: int  # requested output tokens
    start_s: float  # send time, from the start of the run
    status: str  # "ok", "http_<code>" (e.g. http_429), "error" or "timeout"
    ttft_s: float | None = None
    itl_s: tuple[float, ...] = ()
    e2e_s: float | None = None
    output_tokens: int = 0  # the server's usage when it reports one, else content chunks seen
    prompt_tokens_reported: int | None = None  # the server's usage.prompt_tokens
    error: str = ""
    retry_after_s: float | None = None  # a refusal's Retry-After header, in seconds

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict:
        out = asdict(self)
        out["itl_s"] = [round(x, 6) for x in self.itl_s]
        out["tpot_s"] = self.tpot_s
        return out


@dataclass(frozen=True)
class SLO:
    ttft_s: float = 1.0
    tpot_s: float = 0.1

    def met_by(self, record: RequestRecord) -> bool:
        """A completed request within both targets. One output token has no TPOT to miss."""
        if not record.ok or record.ttft_s is None or record.ttft_s > self.ttft_s:
            return False
        tpot = record.tpot_s
        return tpot is None or tpot <= self.tpot_s


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default);
    None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(rank), math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


@dataclass(frozen=True)
class Distribution:
    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None

    @classmethod
    def of(cls, values: Iterable[float]) -> Distribution:
        v = list(values)
        return cls(len(v), sum(v) / len(v) if v else None, *(percentile(v, q) for q in PERCENTILES),
                   max(v) if v else None)


@dataclass(frozen=True)
class Summary:
    requests: int
    completed: int
    wall_s: float  # first send -> last response ended
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens of completed requests / s
    total_token_throughput: float  # (prompt + output) tokens of completed requests / s
    streamed_output_throughput: float  # output tokens received by all requests, finished or not
    goodput: float  # completed requests meeting the SLO / s
    goodput_fraction: float  # of all requests sent
    slo: SLO
    ttft_s: Distribution
    tpot_s: Distribution
    itl_s: Distribution
    e2e_s: Distribution
    rejected_429: int
    rejected_503: int
    http_errors: dict[str, int] = field(default_factory=dict)  # other http_<code> statuses
    errors: int = 0  # transport errors and error events mid-stream
    timeouts: int = 0  # still running when the run's drain deadline passed
    inexact_outputs: int = 0  # completed with a different number of tokens than asked for
    inexact_prompts: int = 0  # server counted a different number of prompt tokens

    def to_json(self) -> dict:
        return asdict(self)


def summarize(records: Sequence[RequestRecord], wall_s: float, slo: SLO = SLO()) -> Summary:
    done = [r for r in records if r.ok]
    wall = wall_s if wall_s > 0 else float("inf")  # nothing ran: every rate is 0
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens_reported or r.prompt_len for r in done)
    good = sum(1 for r in done if slo.met_by(r))
    statuses: dict[str, int] = {}
    for r in records:
        if r.status.startswith("http_") and r.status not in ("http_429", "http_503"):
            statuses[r.status] = statuses.get(r.status, 0) + 1
    return Summary(
        requests=len(records),
        completed=len(done),
        wall_s=wall_s,
        request_throughput=len(done) / wall,
        output_throughput=out_tokens / wall,
        total_token_throughput=(in_tokens + out_tokens) / wall,
        streamed_output_throughput=sum(r.output_tokens for r in records) / wall,
        goodput=good / wall,
        goodput_fraction=good / len(records) if records else 0.0,
        slo=slo,
        ttft_s=Distribution.of(r.ttft_s for r in done if r.ttft_s is not None),
        tpot_s=Distribution.of(t for r in done if (t := r.tpot_s) is not None),
        itl_s=Distribution.of(gap for r in done for gap in r.itl_s),
        e2e_s=Distribution.of(r.e2e_s for r in done if r.e2e_s is not None),
        rejected_429=sum(1 for r in records if r.status == "http_429"),
        rejected_503=sum(1 for r in records if r.status == "http_503"),
        http_errors=statuses,
        errors=sum(1 for r in records if r.status == "error"),
        timeouts=sum(1 for r in records if r.status == "timeout"),
        inexact_outputs=sum(1 for r in done if r.output_tokens != r.output_len),
        inexact_prompts=sum(1 for r in done if r.prompt_tokens_reported is not None
                            and r.prompt_tokens_reported != r.prompt_len),
    )


def summarize_by_class(records: Sequence[RequestRecord], wall_s: float,
                       slo: SLO = SLO()) -> dict[str, Summary]:
    classes = sorted({r.cls for r in records})
    return {c: summarize([r for r in records if r.cls == c], wall_s, slo) for c in classes}
