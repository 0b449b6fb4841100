"""A discrete-event simulator of a disaggregated cluster, timed by a HardwareProfile.

It mirrors the real request path: the gateway reserves KV on the decode worker with the most
free blocks and queues the prompt on the prefill worker with the fewest queued tokens; prefill
runs batched steps under the token budget (prompts chunked at the long-prefill threshold) and
the first token is TTFT; the KV moves to decode, where the request joins the next continuous-
batching step. Replicas take the profile's start-up time to serve, leave by draining, and
publish the same stats as the Redis registry, so the real control loop can run against it.
Single-threaded; time is simulated seconds.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.autoscaler.profile import HardwareProfile
from services.autoscaler.traces import Trace
from services.common.registry import WorkerInfo


@dataclass(frozen=True)
class SimSettings:
    overhead_s: float = 0.01  # per request: gateway and RPC hops before TTFT
    kv_bandwidth_bytes_per_s: float = 2e9  # prefill -> decode KV hand-off
    startup_s: float | None = None  # None: the profile's worker start-up
    drain_tail_s: float = 600.0  # after the trace ends, how long requests may still finish
    # Replays a machine whose speed changed over time (a shared host): while slowdown(role, t)
    # is k, a `role` step progresses at 1/k of the profile's speed; the factor is read once per
    # slowdown_step_s. None: the profile's speed throughout.
    slowdown: Callable[[str, float], float] | None = None
    slowdown_step_s: float = 1.0


@dataclass(eq=False)
class SimRequest:
    id: int
    arrival: float
    prompt: int
    output: int
    first_token: float | None = None
    done: float | None = None
    failed: bool = False
    generated: int = 0
    blocks: int = 0
    decode: SimReplica | None = None
    prefill: SimReplica | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def itl(self) -> float | None:
        if self.done is None or self.first_token is None:
            return None
        return (self.done - self.first_token) / max(self.output - 1, 1)


@dataclass(eq=False)
class SimReplica:
    id: int
    role: str
    started: float
    state: str = "starting"  # starting | ready | draining | stopped | failed
    stopped: float | None = None
    computed_tokens: int = 0
    steps: int = 0
    busy: bool = False
    # prefill: [request, prompt tokens left]
    queue: deque = field(default_factory=deque)
    # decode
    kv_blocks_total: int = 0
    blocks_used: int = 0
    reserved: set = field(default_factory=set)  # waiting for KV
    joining: list = field(default_factory=list)  # KV arrived, joins the next step
    running: list = field(default_factory=list)

    @property
    def serving(self) -> bool:
        return self.state == "ready"

    @property
    def queued_tokens(self) -> int:
        return sum(left for _, left in self.queue)

    @property
    def idle(self) -> bool:
        return not (self.busy or self.queue or self.reserved or self.joining or self.running)

    def stats(self) -> dict[str, float]:
        return {
            "running": len(self.running) + len(self.joining), "waiting": 0,
            "waiting_for_kv": len(self.reserved), "kv_blocks_total": self.kv_blocks_total,
            "kv_blocks_free": self.kv_blocks_total - self.blocks_used,
            "queued_prefill_tokens": self.queued_tokens, "computed_tokens": self.computed_tokens,
            "steps": self.steps,
        }


class ClusterSim:
    def __init__(self, profile: HardwareProfile, trace: Trace, settings: SimSettings | None = None) -> None:
        self.profile = profile
        self.trace = trace
        self.settings = settings or SimSettings()
        s = self.settings.startup_s
        self.startup_s = profile.startup_s if s is None else s
        self.now = 0.0
        self._events: list = []
        self._seq = itertools.count()
        self._ids = itertools.count()
        self.replicas: list[SimReplica] = []
        self.pending: deque[SimRequest] = deque()
        self.requests = [SimRequest(i, r.arrival, r.prompt_tokens, r.output_tokens)
                         for i, r in enumerate(trace.requests)]

    # -- the event loop ------------------------------------------------------------------

    def at(self, time: float, fn: Callable, *args) -> None:
        heapq.heappush(self._events, (time, next(self._seq), fn, args))

    def every(self, interval: float, fn: Callable[[float], None], until: float) -> None:
        def tick() -> None:
            fn(self.now)
            if self.now + interval <= until:
                self.at(self.now + interval, tick)
        self.at(0.0, tick)

    def run(self) -> None:
        for request in self.requests:
            self.at(request.arrival, self._arrive, request)
        for when, role in self.trace.failures:
            self.at(when, self.fail_one, role)
        end = self.trace.duration_s + self.settings.drain_tail_s
        while self._events:
            time, _, fn, args = heapq.heappop(self._events)
            if time > end:
                break
            self.now = time
            fn(*args)
            if self.now >= self.trace.duration_s and all(
                    r.done is not None or r.failed for r in self.requests):
                break

    # -- replicas ------------------------------------------------------------------------

    def add_replica(self, role: str, ready: bool = False) -> SimReplica:
        replica = SimReplica(next(self._ids), role, self.now)
        if role == "decode":
            replica.kv_blocks_total = self.profile.kv_blocks
        self.replicas.append(replica)
        if ready:
            replica.state = "ready"
        else:
            self.at(self.now + self.startup_s, self._ready, replica)
        return replica

    def _ready(self, replica: SimReplica) -> None:
        if replica.state == "starting":
            replica.state = "ready"
            self._dispatch()

    def live(self, role: str) -> list[SimReplica]:
        """Asked-for replicas: starting or ready (draining ones are on their way out)."""
        return [r for r in self.replicas if r.role == role and r.state in ("starting", "ready")]

    def drain(self, replica: SimReplica) -> None:
        if replica.state == "starting":
            self._stop(replica, "stopped")
            return
        replica.state = "draining"
        self._maybe_stopped(replica)

    def _maybe_stopped(self, replica: SimReplica) -> None:
        if replica.state == "draining" and replica.idle:
            self._stop(replica, "stopped")

    def _stop(self, replica: SimReplica, state: str) -> None:
        replica.state = state
        replica.stopped = self.now

    def fail_one(self, role: str) -> None:
        """The busiest serving replica of `role` dies; requests that had streamed tokens fail,
        the others go back to the gateway (retried before their first token). Its Deployment
        (the same for every policy) replaces it after a start-up time."""
        victims = [r for r in self.replicas if r.role == role and r.serving]
        if not victims:
            return
        victim = max(victims, key=lambda r: len(r.running) + len(r.queue))
        self._stop(victim, "failed")
        if role == "prefill":
            for request, _ in victim.queue:
                self._release(request)
                self.pending.appendleft(request)
            victim.queue.clear()
        else:
            for request in [*victim.running, *victim.joining, *victim.reserved]:
                if request.first_token is None:  # still in prefill: retried invisibly
                    self._release(request)
                    self.pending.appendleft(request)
                else:
                    request.failed = True
                    request.decode = None
            victim.running, victim.joining, victim.reserved = [], [], set()
            victim.blocks_used = 0
        self.add_replica(role)
        self._dispatch()

    def _release(self, request: SimRequest) -> None:
        """Undo the routing of a request that has not reached its decode worker's batch."""
        decode = request.decode
        if decode is not None and request in decode.reserved:
            decode.reserved.discard(request)
            decode.blocks_used -= request.blocks
        if request.prefill is not None:
            request.prefill.queue = deque(e for e in request.prefill.queue if e[0] is not request)
        request.decode = request.prefill = None

    def registry_view(self) -> list[WorkerInfo]:
        """What the Redis registry would list now: serving workers and their stats."""
        return [WorkerInfo(worker_id=f"{r.role}-{r.id}", role=r.role, address=f"sim:{r.id}",
                           kv_endpoint="", model=self.profile.model,
                           block_size=self.profile.block_size, max_model_len=0,
                           stats=r.stats(), updated=self.now)
                for r in self.replicas if r.serving]

    # -- the request path ----------------------------------------------------------------

    def _arrive(self, request: SimRequest) -> None:
        self.pending.append(request)
        self._dispatch()

    def _dispatch(self) -> None:
        """FIFO from the gateway: a decode worker with room for the request's KV (most free
        blocks first) and the prefill worker with the fewest queued tokens."""
        profile = self.profile
        while self.pending:
            request = self.pending[0]
            blocks = profile.blocks_for(request.prompt)  # reserved for the prompt's KV
            decoders = [r for r in self.replicas if r.role == "decode" and r.serving
                        and r.kv_blocks_total - r.blocks_used >= blocks
                        and len(r.running) + len(r.joining) + len(r.reserved) < profile.max_num_seqs]
            prefillers = [r for r in self.replicas if r.role == "prefill" and r.serving]
            if not decoders or not prefillers:
                return
            self.pending.popleft()
            decode = max(decoders, key=lambda r: r.kv_blocks_total - r.blocks_used)
            prefill = min(prefillers, key=lambda r: (r.queued_tokens, r.id))
            request.blocks, request.decode, request.prefill = blocks, decode, prefill
            decode.blocks_used += blocks
            decode.reserved.add(request)
            prefill.queue.append([request, request.prompt])
            if not prefill.busy:
                self._prefill_step(prefill)

    def _prefill_step(self, replica: SimReplica) -> None:
        if not replica.queue or replica.state not in ("ready", "draining"):
            replica.busy = False
            self._maybe_stopped(replica)
            return
        profile, budget, batch = self.profile, self.profile.max_num_batched_tokens, []
        for entry in replica.queue:
            # Nothing decodes on a prefill worker: prompts go whole, up to the budget.
            take = min(entry[1], budget)
            if take <= 0 or len(batch) >= profile.max_num_seqs:
                break
            batch.append((entry, take))
            budget -= take
        tokens = sum(take for _, take in batch)
        replica.busy = True
        self.at(self.now + self._scaled("prefill", profile.prefill_seconds(tokens)), self._prefill_done,
                replica, batch, tokens)

    def _prefill_done(self, replica: SimReplica, batch, tokens: int) -> None:
        if replica.state == "failed":
            return
        replica.computed_tokens += tokens
        replica.steps += 1
        for entry, take in batch:
            if not any(e is entry for e in replica.queue):
                continue  # released meanwhile (its decode worker failed): retried elsewhere
            entry[1] -= take
            if entry[1] > 0:
                continue
            request = entry[0]
            replica.queue.remove(entry)
            request.first_token = self.now + self.settings.overhead_s
            request.prefill = None
            kv_bytes = self.profile.blocks_for(request.prompt) * self.profile.kv_bytes_per_block
            transfer = kv_bytes / self.settings.kv_bandwidth_bytes_per_s
            self.at(request.first_token + transfer, self._kv_arrived, request)
        self._prefill_step(replica)

    def _kv_arrived(self, request: SimRequest) -> None:
        decode = request.decode
        if decode is None or request not in decode.reserved:
            return  # its decode worker failed meanwhile
        decode.reserved.discard(request)
        request.generated = 1  # the first token came from prefill
        if request.generated >= request.output:
            self._finish(decode, request)
            return
        decode.joining.append(request)
        if not decode.busy:
            self._decode_step(decode)

    def _decode_step(self, replica: SimReplica) -> None:
        replica.running.extend(replica.joining)
        replica.joining.clear()
        if not replica.running:
            replica.busy = False
            self._maybe_stopped(replica)
            return
        batch = len(replica.running)
        context = sum(r.prompt + r.generated for r in replica.running) / batch
        replica.busy = True
        self.at(self.now + self._scaled("decode", self.profile.decode_step_seconds(batch, context)),
                self._decode_done, replica)

    def _scaled(self, role: str, seconds: float) -> float:
        """Wall time of a step of `seconds` of profile time starting now (see SimSettings)."""
        slowdown, step = self.settings.slowdown, self.settings.slowdown_step_s
        if slowdown is None:
            return seconds
        t, left = self.now, seconds
        while True:
            factor = max(slowdown(role, t), 1e-9)
            segment = (t // step + 1) * step - t
            if left * factor <= segment:
                return t + left * factor - self.now
            left -= segment / factor
            t += segment

    def _decode_done(self, replica: SimReplica) -> None:
        if replica.state == "failed":
            return
        replica.computed_tokens += len(replica.running)
        replica.steps += 1
        still = []
        for request in replica.running:
            request.generated += 1
            # The KV grows a block at a time (preemption on exhaustion is not modelled: the
            # planner keeps KV use below its kv_utilization).
            if request.prompt + request.generated > request.blocks * self.profile.block_size:
                request.blocks += 1
                replica.blocks_used += 1
            if request.generated >= request.output:
                self._finish(replica, request)
            else:
                still.append(request)
        replica.running = still
        self._decode_step(replica)

    def _finish(self, replica: SimReplica, request: SimRequest) -> None:
        request.done = self.now
        replica.blocks_used -= request.blocks
        request.decode = None
        self._dispatch()


class SimActuator:
    """The Actuator interface over a ClusterSim: new replicas start after the start-up time;
    removed ones drain (a starting one is simply cancelled)."""

    def __init__(self, sim: ClusterSim) -> None:
        self.sim = sim

    def replicas(self, role: str) -> int:
        return len(self.sim.live(role))

    def scale(self, role: str, replicas: int, workers: Sequence[WorkerInfo] = ()) -> None:
        live = self.sim.live(role)
        for _ in range(replicas - len(live)):
            self.sim.add_replica(role)
        if len(live) > replicas:
            live.sort(key=lambda r: (r.state != "starting", len(r.running) + len(r.reserved)
                                     + r.queued_tokens / 1000))
            for replica in live[: len(live) - replicas]:
                self.sim.drain(replica)

    def close(self) -> None:
        pass


class SimSource:
    """The WorkerSource interface over a ClusterSim (what the registry would return)."""

    def __init__(self, sim: ClusterSim) -> None:
        self.sim = sim

    def workers(self) -> list[WorkerInfo]:
        return self.sim.registry_view()
