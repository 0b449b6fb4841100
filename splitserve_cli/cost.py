"""`splitserve cost`: what the requests in a gateway's access log cost, from the engine seconds
the workers charged each one (usage.splitserve.compute_seconds) and a price per worker-hour.

Reads JSON access-log lines (the gateway's default --log-format json) from files or stdin.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime

PHASES = ("prefill", "decode", "transfer")
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


@dataclass(frozen=True)
class Price:
    gpu: str
    usd_per_hour: float

    @property
    def usd_per_second(self) -> float:
        return self.usd_per_hour / 3600


@dataclass
class Tally:
    """Requests of one tenant (or all) in the window."""

    requests: int = 0
    output_tokens: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    @property
    def compute_s(self) -> float:
        return sum(self.seconds.values())

    def add(self, tokens: int, seconds: dict[str, float]) -> None:
        """One request's figures, as figures() reads them."""
        self.requests += 1
        self.output_tokens += tokens
        for phase, value in seconds.items():
            self.seconds[phase] += value


def figures(entry: dict) -> tuple[int, dict[str, float]]:
    """An access line's output tokens and compute seconds by phase; ValueError (or TypeError,
    AttributeError) for figures that are not counts."""
    tokens = int(entry.get("completion_tokens") or 0)
    seconds = {phase: float(entry["compute_seconds"].get(phase) or 0.0) for phase in PHASES}
    if tokens < 0 or any(not 0 <= s < float("inf") for s in seconds.values()):
        raise ValueError("negative or infinite figures")
    return tokens, seconds


def parse_price(text: str) -> Price:
    gpu, sep, usd = text.partition("=")
    try:
        value = float(usd)
    except ValueError:
        value = -1.0
    if not sep or not gpu or not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(
            f"--price-per-hour wants GPU=USD per worker-hour, e.g. H100=2.49 (got {text!r})")
    return Price(gpu, value)


def parse_duration(text: str) -> float:
    match = _DURATION.match(text.strip())
    if not match or float(match[1]) <= 0:
        raise argparse.ArgumentTypeError(
            f"--since wants a duration such as 90s, 15m, 1h or 2d (got {text!r})")
    return float(match[1]) * _UNIT_SECONDS[match[2]]


def parse_time(text: str) -> float:
    """An ISO 8601 time (UTC unless it says otherwise) as seconds since the epoch."""
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--until wants an ISO time such as 2026-12-01T18:00:00Z (got {text!r})") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def access_entries(lines: Iterable[str]) -> Iterator[tuple[float, dict]]:
    """(time, entry) of each access-log line that carries compute seconds; other lines (the
    gateway's own logs, text lines, records from before cost per query) are skipped. A line
    that `splitserve up` prefixed with its service (`[gateway] {...}`) is read without it."""
    for line in lines:
        line = line.strip()
        if line.startswith("[") and "] {" in line:
            line = line[line.index("] {") + 2:]
        if not line.startswith("{"):
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if (not isinstance(entry, dict) or entry.get("logger") != "splitserve.access"
                or not isinstance(entry.get("compute_seconds"), dict)):
            continue
        try:
            yield parse_time(str(entry.get("ts", ""))), entry
        except argparse.ArgumentTypeError:
            continue


@dataclass
class Report:
    start: float
    end: float
    price: Price
    workers: int
    total: Tally = field(default_factory=Tally)
    tenants: dict[str, Tally] = field(default_factory=dict)

    @property
    def capacity_s(self) -> float:
        return self.workers * (self.end - self.start)

    @property
    def idle_share(self) -> float:
        if self.capacity_s <= 0:
            return 0.0
        return max(0.0, 1.0 - self.total.compute_s / self.capacity_s)

    def charged_usd(self, tally: Tally) -> float:
        return tally.compute_s * self.price.usd_per_second

    def with_idle_usd(self, tally: Tally) -> float:
        """The tally's share (by compute seconds) of what the whole capacity cost; never less
        than what it was charged (compute past the capacity: requests logged in the window
        that ran partly before it, or fewer workers given than ran)."""
        if self.total.compute_s <= 0:
            return 0.0
        paid_s = max(self.capacity_s, self.total.compute_s)
        return paid_s * self.price.usd_per_second * tally.compute_s / self.total.compute_s


def build_report(entries: Iterable[tuple[float, dict]], start: float, end: float, price: Price,
                 workers: int | None) -> Report:
    seen: set[str] = set()
    report = Report(start, end, price, workers or 0)
    for at, entry in entries:
        if not start <= at <= end:
            continue
        try:  # a line with figures that are not counts is skipped, as one that is not JSON
            tokens, seconds = figures(entry)
        except (ValueError, TypeError, AttributeError):
            continue
        report.total.add(tokens, seconds)
        tenant = str(entry.get("tenant") or "unknown")
        report.tenants.setdefault(tenant, Tally()).add(tokens, seconds)
        seen.update(str(w) for w in (entry.get("decode_worker"), entry.get("prefill_worker")) if w)
    if workers is None:
        report.workers = len(seen)
    return report


def _usd(value: float) -> str:
    return f"${value:.6f}" if value < 1 else f"${value:,.2f}"


def _per_1k(usd: float, tokens: int) -> str:
    return _usd(1000 * usd / tokens) if tokens else "-"


def render(report: Report) -> str:
    total, price = report.total, report.price
    iso = "%Y-%m-%dT%H:%M:%SZ"
    out = [
        f"window      {time.strftime(iso, time.gmtime(report.start))} .. "
        f"{time.strftime(iso, time.gmtime(report.end))} ({report.end - report.start:.0f}s)",
        f"price       {price.gpu} at ${price.usd_per_hour:g} per worker-hour, "
        f"{report.workers} workers",
        f"requests    {total.requests}, {total.output_tokens} output tokens",
        "compute     " + "  ".join(f"{p} {total.seconds[p]:.3f}s" for p in PHASES)
        + f"  total {total.compute_s:.3f}s",
    ]
    if report.capacity_s > 0:
        out.append(f"capacity    {report.capacity_s:.0f} worker-seconds, busy "
                   f"{1 - report.idle_share:.1%}, idle {report.idle_share:.1%}")
        if total.compute_s > report.capacity_s:
            out.append(f"note        compute ({total.compute_s:.1f}s) exceeds the capacity: "
                       "requests logged in the window ran partly before it, or more workers "
                       "ran than --workers says")
    else:
        out.append("capacity    unknown (no workers named in the window; pass --workers)")
    charged, whole = report.charged_usd(total), report.with_idle_usd(total)
    out.append(f"cost        {_usd(charged)} charged to requests"
               + (f", {_usd(whole)} with idle capacity" if report.capacity_s > 0 else ""))
    if total.requests:
        out.append(f"per request {_usd(charged / total.requests)} charged, "
                   f"{_usd(whole / total.requests)} with idle")
        out.append(f"per 1k out  {_per_1k(charged, total.output_tokens)} charged, "
                   f"{_per_1k(whole, total.output_tokens)} with idle")
    out.append("")
    out.append(f"{'tenant':<20} {'requests':>8} {'out_tok':>8} {'compute_s':>10} "
               f"{'usd/req':>11} {'usd/1k_out':>11} {'usd_w_idle':>11}")
    for name, tally in sorted(report.tenants.items(), key=lambda kv: -kv[1].compute_s):
        usd = report.charged_usd(tally)
        out.append(f"{name[:20]:<20} {tally.requests:>8} {tally.output_tokens:>8} "
                   f"{tally.compute_s:>10.3f} {_usd(usd / tally.requests):>11} "
                   f"{_per_1k(usd, tally.output_tokens):>11} "
                   f"{_usd(report.with_idle_usd(tally)):>11}")
    return "\n".join(out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logs", nargs="*", default=["-"],
                        help="gateway access-log files (JSON lines); '-' or none: stdin")
    parser.add_argument("--price-per-hour", required=True, type=parse_price, metavar="GPU=USD",
                        help="price of one worker (one GPU) per hour, e.g. H100=2.49")
    parser.add_argument("--since", default="1h", type=parse_duration,
                        help="window length before --until (90s, 15m, 1h, 2d; default 1h)")
    parser.add_argument("--until", type=parse_time, default=None,
                        help="window end, ISO time (default: now)")
    parser.add_argument("--workers", type=int, default=None,
                        help="workers paid for in the window (default: those the log names)")


def run(args: argparse.Namespace) -> int:
    if args.workers is not None and args.workers < 0:
        print("splitserve cost: --workers must be >= 0", file=sys.stderr)
        return 2
    end = args.until if args.until is not None else time.time()
    lines: list[Iterable[str]] = []
    try:
        for name in args.logs:
            lines.append(sys.stdin if name == "-" else open(name, encoding="utf-8",  # noqa: SIM115
                                                           errors="replace"))
    except OSError as exc:
        print(f"splitserve cost: cannot read {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    try:
        entries = (e for source in lines for e in access_entries(source))
        report = build_report(entries, end - args.since, end, args.price_per_hour, args.workers)
    finally:
        for source in lines:
            if source is not sys.stdin:
                source.close()
    if report.total.requests == 0:
        print("splitserve cost: no access-log lines with compute_seconds in the window "
              "(the gateway must log JSON: --log-format json)", file=sys.stderr)
    print(render(report))
    return 0

