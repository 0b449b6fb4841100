"""The local actuator: worker processes on this machine that register themselves in Redis.

Scale-up starts a process on a background thread (a worker takes seconds to load, and the
control loop must keep running meanwhile). With a warm pool (`warm_pool={"decode": 1}`) it
keeps that many workers per role started with `--standby` (model loaded, not registered):
scale-up activates one of them through Redis, which serves within about a second, and starts
a replacement standby behind it. Scale-down sends SIGTERM to the least-loaded worker of the
role, which drains (deregisters, refuses new work, finishes its requests) and exits. All
bookkeeping is under one lock: starter threads and the control loop both touch it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.autoscaler.actuators import worker_load
from services.common.registry import WorkerInfo
from services.common.standby import activate
from splitserve_cli.processes import WorkerProcess, start_worker

log = logging.getLogger(__name__)


@dataclass(eq=False)
class LocalWorker:
    role: str
    port: int  # 0 until the worker has bound one and reported it
    worker_id: str
    started: float = field(default_factory=time.monotonic)
    process: WorkerProcess | None = None  # None while starting
    state: str = "starting"  # starting | standby | ready | draining | exited | failed
    standby: bool = False  # started with --standby (for the warm pool)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


class LocalActuator:
    def __init__(self, model: str, redis_url: str, worker_args: dict[str, Sequence[str]] | None = None,
                 start_timeout_s: float = 300.0, warm_pool: dict[str, int] | None = None,
                 secret: bytes | None = None) -> None:
        self.model = model
        self.redis_url = redis_url
        self.worker_args = {role: list(args) for role, args in (worker_args or {}).items()}
        self.start_timeout_s = start_timeout_s
        if any(n < 0 for n in (warm_pool or {}).values()):
            raise ValueError("a warm pool size must be >= 0")
        self.warm_pool = dict(warm_pool or {})
        # Signs activations when the workers have a cluster secret (they ignore unsigned ones).
        self.secret = secret if secret is not None else _secret_in(self.worker_args)
        self.workers: list[LocalWorker] = []
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._started = 0  # workers started so far: numbers their ids

    # -- the Actuator interface ----------------------------------------------------------

    def replicas(self, role: str) -> int:
        with self._lock:
            self._reap()
            self._refill(role)
            return len(self._serving(role))

    def scale(self, role: str, replicas: int, workers: Sequence[WorkerInfo] = ()) -> None:
        with self._lock:
            self._reap()
            live = self._serving(role)
            for _ in range(replicas - len(live)):
                pooled = [w for w in self._pool(role) if w.state == "standby"]
                if pooled:
                    self._activate(pooled[0])
                else:
                    self._start(role)
            self._refill(role)
            if len(live) > replicas:
                load = {info.worker_id: worker_load(info) for info in workers}
                # Drain the idlest ready workers; a worker still starting is the cheapest to stop.
                live.sort(key=lambda w: (w.state != "starting", load.get(w.worker_id, 0.0)))
                for worker in live[: len(live) - replicas]:
                    self._drain(worker)

    def close(self, timeout_s: float = 60.0) -> None:
        """Drain every worker and wait for them to exit."""
        with self._lock:
            for worker in self.workers:
                if worker.state in ("starting", "standby", "ready"):
                    self._drain(worker)
        for thread in self._threads:
            thread.join(timeout_s)
        deadline = time.monotonic() + timeout_s
        for worker in list(self.workers):
            if worker.process is not None:
                left = max(0.1, deadline - time.monotonic())
                try:
                    worker.process.process.wait(left)
                except Exception:
                    worker.process.kill()

    def standby(self, role: str) -> list[LocalWorker]:
        """The role's warm pool: started (or starting) with --standby, not yet activated."""
        with self._lock:
            return self._pool(role)

    # -- processes -----------------------------------------------------------------------

    def _serving(self, role: str) -> list[LocalWorker]:
        """Workers asked to serve: ready, or starting as a serving (not a standby) worker."""
        return [w for w in self.workers if w.role == role
                and (w.state == "ready" or (w.state == "starting" and not w.standby))]

    def _pool(self, role: str) -> list[LocalWorker]:
        return [w for w in self.workers if w.role == role and w.standby
                and w.state in ("starting", "standby")]

    def _refill(self, role: str) -> None:
        """Start standby workers until the role's pool holds its size (counting those starting)."""
        for _ in range(self.warm_pool.get(role, 0) - len(self._pool(role))):
            self._start(role, standby=True)

    def _activate(self, worker: LocalWorker) -> None:
        """Bring a standby worker in: it writes its registry entry within its poll (50 ms)."""
        log.info("activating standby %s worker %s", worker.role, worker.worker_id)
        try:
            activate(self.redis_url, worker.worker_id, self.secret)
        except Exception as exc:  # Redis down: the worker stays in the pool; start another
            log.error("could not activate %s: %s; starting a worker instead", worker.worker_id, exc)
            self._start(worker.role)
            return
        worker.state = "ready"

    def _start(self, role: str, standby: bool = False) -> None:
        # The worker binds a free port itself and reports it: one picked here could be taken
        # by another process before the worker binds it.
        self._started += 1
        worker = LocalWorker(role, 0, f"{role}-local-{os.getpid()}-{self._started}",
                             standby=standby)
        self.workers.append(worker)
        log.info("starting %s worker %s%s", role, worker.worker_id, " (standby)" if standby else "")
        thread = threading.Thread(target=self._launch, args=(worker,), daemon=True,
                                  name=f"start-{worker.worker_id}")
        self._threads.append(thread)
        thread.start()

    def _launch(self, worker: LocalWorker) -> None:
        try:
            process = start_worker(
                worker.role, self.model, "--redis-url", self.redis_url,
                "--worker-id", worker.worker_id, *self.worker_args.get(worker.role, ()),
                *(("--standby",) if worker.standby else ()),
                timeout=self.start_timeout_s,
            )
        except Exception as exc:
            log.error("%s worker %s failed to start: %s", worker.role, worker.worker_id, exc)
            with self._lock:
                worker.state = "failed"
            return
        with self._lock:
            worker.process = process
            worker.port = process.port
            if worker.state == "draining":  # asked to stop while it was starting
                process.process.send_signal(signal.SIGTERM)
            else:
                worker.state = "standby" if worker.standby else "ready"
                log.info("%s worker %s %s after %.1fs", worker.role, worker.worker_id,
                         "standing by" if worker.standby else "ready",
                         time.monotonic() - worker.started)

    def _drain(self, worker: LocalWorker) -> None:
        log.info("draining %s worker %s", worker.role, worker.worker_id)
        if worker.process is not None and worker.process.process.poll() is None:
            worker.process.process.send_signal(signal.SIGTERM)
        worker.state = "draining"

    def _reap(self) -> None:
        for worker in self.workers:
            if worker.process is None or worker.state in ("exited", "failed"):
                continue
            code = worker.process.process.poll()
            if code is None:
                continue
            if worker.state == "draining":
                log.info("%s worker %s drained and exited (code %d)", worker.role, worker.worker_id, code)
                worker.state = "exited"
            else:
                log.error("%s worker %s died (code %d)", worker.role, worker.worker_id, code)
                worker.state = "failed"


def _secret_in(worker_args: dict[str, list[str]]) -> bytes | None:
    """The cluster secret the workers are started with (--cluster-secret-file), if any."""
    from services.common.security import read_cluster_secret

    for args in worker_args.values():
        for i, arg in enumerate(args):
            if arg == "--cluster-secret-file" and i + 1 < len(args):
                return read_cluster_secret(args[i + 1])
            if arg.startswith("--cluster-secret-file="):
                return read_cluster_secret(arg.split("=", 1)[1])
    return None
