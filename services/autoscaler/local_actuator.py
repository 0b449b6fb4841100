"""The local actuator: worker processes on this machine that register themselves in Redis.

Scale-up starts a process on a background thread (a worker takes seconds to load, and the
control loop must keep running meanwhile). Scale-down sends SIGTERM to the least-loaded worker
of the role, which drains (deregisters, refuses new work, finishes its requests) and exits.
All bookkeeping is under one lock: starter threads and the control loop both touch it.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.autoscaler.actuators import worker_load
from services.common.registry import WorkerInfo
from splitserve_cli.processes import WorkerProcess, free_port, start_worker

log = logging.getLogger(__name__)


@dataclass(eq=False)
class LocalWorker:
    role: str
    port: int
    worker_id: str
    started: float = field(default_factory=time.monotonic)
    process: WorkerProcess | None = None  # None while starting
    state: str = "starting"  # starting | ready | draining | exited | failed

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


class LocalActuator:
    def __init__(self, model: str, redis_url: str, worker_args: dict[str, Sequence[str]] | None = None,
                 start_timeout_s: float = 300.0) -> None:
        self.model = model
        self.redis_url = redis_url
        self.worker_args = {role: list(args) for role, args in (worker_args or {}).items()}
        self.start_timeout_s = start_timeout_s
        self.workers: list[LocalWorker] = []
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    # -- the Actuator interface ----------------------------------------------------------

    def replicas(self, role: str) -> int:
        with self._lock:
            self._reap()
            return sum(1 for w in self.workers if w.role == role and w.state in ("starting", "ready"))

    def scale(self, role: str, replicas: int, workers: Sequence[WorkerInfo] = ()) -> None:
        with self._lock:
            self._reap()
            live = [w for w in self.workers if w.role == role and w.state in ("starting", "ready")]
            for _ in range(replicas - len(live)):
                self._start(role)
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
                if worker.state in ("starting", "ready"):
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

    # -- processes -----------------------------------------------------------------------

    def _start(self, role: str) -> None:
        port = free_port()
        worker = LocalWorker(role, port, f"{role}-local-{port}")
        self.workers.append(worker)
        log.info("starting %s worker %s", role, worker.worker_id)
        thread = threading.Thread(target=self._launch, args=(worker,), daemon=True,
                                  name=f"start-{worker.worker_id}")
        self._threads.append(thread)
        thread.start()

    def _launch(self, worker: LocalWorker) -> None:
        try:
            process = start_worker(
                worker.role, self.model, "--redis-url", self.redis_url,
                "--worker-id", worker.worker_id, *self.worker_args.get(worker.role, ()),
                port=worker.port, timeout=self.start_timeout_s,
            )
        except Exception as exc:
            log.error("%s worker %s failed to start: %s", worker.role, worker.worker_id, exc)
            with self._lock:
                worker.state = "failed"
            return
        with self._lock:
            worker.process = process
            if worker.state == "draining":  # asked to stop while it was starting
                process.process.send_signal(signal.SIGTERM)
            else:
                worker.state = "ready"
                log.info("%s worker %s ready after %.1fs", worker.role, worker.worker_id,
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
