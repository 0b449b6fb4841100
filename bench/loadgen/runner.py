"""Runs a workload against a target: schedules sends by the arrival process, keeps the streams
going concurrently on one event loop, and summarizes the records.

A closed-loop client refused with a Retry-After header waits that long (at most
RETRY_AFTER_CAP_S) before its next request, as the openai SDK does.

Everything here runs on the caller's event loop. Prompts for open-loop runs are all built before
the first send, so tokenizing never delays a send or a chunk timestamp.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Protocol

import httpx
import numpy as np
from tqdm.auto import tqdm

from bench.loadgen.arrivals import ArrivalProcess, ClosedLoop
from bench.loadgen.client import Target, send
from bench.loadgen.metrics import (
    SLO,
    Distribution,
    RequestRecord,
    Summary,
    summarize,
    summarize_by_class,
)
from bench.loadgen.prompts import BuiltPrompt
from bench.loadgen.workload import RequestSpec, Workload

# A closed-loop client refused with Retry-After waits that long, at most this (the openai SDK
# honours Retry-After up to 60 s; a benchmark run is shorter).
RETRY_AFTER_CAP_S = 5.0


class PromptSource(Protocol):
    def build(self, spec: RequestSpec, rng: np.random.Generator,
              prefix_len: int = 0) -> BuiltPrompt: ...


@dataclass(frozen=True)
class RunConfig:
    target: Target
    workload: Workload
    arrivals: ArrivalProcess
    duration_s: float = 60.0  # arrivals are drawn over this window
    num_requests: int | None = None  # at most this many requests
    seed: int = 0
    slo: SLO = field(default_factory=SLO)
    drain_timeout_s: float = 300.0  # after the window, unfinished requests end as 'timeout'
    progress: bool = True

    def describe(self) -> dict:
        return {"url": self.target.url, "model": self.target.model,
                "endpoint": self.target.endpoint, "flavor": self.target.flavor,
                "exact_output_lengths": self.target.exact_lengths,
                "workload": self.workload.describe(), "arrivals": self.arrivals.describe(),
                "duration_s": self.duration_s, "num_requests": self.num_requests,
                "seed": self.seed, "slo": {"ttft_s": self.slo.ttft_s, "tpot_s": self.slo.tpot_s},
                "drain_timeout_s": self.drain_timeout_s}


@dataclass(frozen=True)
class LoadResult:
    config: RunConfig
    records: tuple[RequestRecord, ...]
    wall_s: float
    send_lag_s: Distribution  # how late sends left against their schedule (client overload)
    summary: Summary
    by_class: dict[str, Summary]

    def to_json(self) -> dict:
        return {"config": self.config.describe(), "summary": self.summary.to_json(),
                "by_class": {k: v.to_json() for k, v in self.by_class.items()},
                "send_lag_s": self.send_lag_s.__dict__,
                "requests": [r.to_json() for r in self.records]}


def _streams(seed: int) -> tuple[np.random.Generator, ...]:
    """Independent generators for arrivals, workload and prompt text, so that changing the rate
    does not change which requests are sent."""
    return tuple(np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3))


async def run_load(config: RunConfig, prompts: PromptSource) -> LoadResult:
    arrival_rng, workload_rng, prompt_rng = _streams(config.seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    timeout = httpx.Timeout(connect=30.0, read=None, write=30.0, pool=None)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        if isinstance(config.arrivals, ClosedLoop):
            records, lags, wall = await _closed_loop(config, client, prompts, workload_rng,
                                                     prompt_rng)
        else:
            records, lags, wall = await _open_loop(config, client, prompts, arrival_rng,
                                                   workload_rng, prompt_rng)
    records = sorted(records, key=lambda r: r.index)
    return LoadResult(config, tuple(records), wall, Distribution.of(lags),
                      summarize(records, wall, config.slo),
                      summarize_by_class(records, wall, config.slo))


def _progress(config: RunConfig, total: int | None) -> tqdm:
    return tqdm(total=total, unit="req", disable=not config.progress, dynamic_ncols=True,
                desc=f"{config.workload.name} {config.arrivals.describe()}")


async def _open_loop(config, client, prompts, arrival_rng, workload_rng, prompt_rng):
    times = config.arrivals.times(config.duration_s, arrival_rng)
    if config.num_requests is not None:
        times = times[: config.num_requests]
    specs = config.workload.sample(workload_rng, len(times))
    built = [prompts.build(s, prompt_rng, config.workload.prefix_len).prompt for s in specs]
    loop = asyncio.get_running_loop()
    bar = _progress(config, len(specs))
    failed = 0

    def on_done(task: asyncio.Task) -> None:
        nonlocal failed
        failed += 0 if task.cancelled() or task.result().ok else 1
        bar.update(1)
        bar.set_postfix(failed=failed, refresh=False)

    run_start, loop_start = time.perf_counter(), loop.time()
    deadline = loop_start + (float(times[-1]) if len(times) else 0.0) + config.drain_timeout_s
    tasks, lags = [], []
    for at, spec, prompt in zip(times, specs, built, strict=True):
        delay = loop_start + at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        lags.append(max(0.0, loop.time() - loop_start - at))
        task = asyncio.create_task(send(client, config.target, spec, prompt, run_start, deadline))
        task.add_done_callback(on_done)
        tasks.append(task)
    records = await asyncio.gather(*tasks)
    wall = time.perf_counter() - run_start
    bar.close()
    return list(records), lags, wall


async def _closed_loop(config, client, prompts, workload_rng, prompt_rng):
    specs = config.workload.specs(workload_rng)
    cap = config.num_requests
    total = cap if cap is not None else None
    loop = asyncio.get_running_loop()
    bar = _progress(config, total)
    records: list[RequestRecord] = []
    started = 0
    run_start, loop_start = time.perf_counter(), loop.time()
    stop_at = loop_start + config.duration_s
    deadline = stop_at + config.drain_timeout_s

    async def one_client() -> None:
        nonlocal started
        while loop.time() < stop_at and (cap is None or started < cap):
            started += 1
            spec = next(specs)
            prompt = prompts.build(spec, prompt_rng, config.workload.prefix_len).prompt
            record = await send(client, config.target, spec, prompt, run_start, deadline)
            records.append(record)
            bar.update(1)
            if record.retry_after_s is not None:
                # As the openai SDK does: a refused client waits what the server asks
                # (capped), instead of resending at once and counting one overload many times.
                await asyncio.sleep(min(record.retry_after_s, RETRY_AFTER_CAP_S,
                                        max(stop_at - loop.time(), 0.0)))

    await asyncio.gather(*(one_client() for _ in range(config.arrivals.concurrency)))
    wall = time.perf_counter() - run_start
    bar.close()
    return records, [], wall  # no schedule to be late against


def run_load_sync(config: RunConfig, prompts: PromptSource) -> LoadResult:
    return asyncio.run(run_load(config, prompts))
