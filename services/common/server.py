"""Starts a worker process: engine thread, kv_transfer endpoints, gRPC servicers by role,
and a graceful drain on SIGTERM."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket
import time

import grpc
from splitserve.v1 import decode_pb2_grpc, prefill_pb2_grpc

from engine.executor import TensorParallelExecutor
from engine.llm_engine import LLMEngine
from engine.memory_profile import KVPoolTooSmall
from engine.models.loader import weight_load_seconds
from kernels import cpu_kernels
from services.common.addresses import check_ports_free, host_port, is_loopback
from services.common.core_share import CoreShare
from services.common.engine_build import build_engine
from services.common.engine_loop import EngineLoop
from services.common.health import WorkerState
from services.common.logs import setup_logging
from services.common.malformed import add_servicer
from services.common.memory_metrics import MemoryCollector
from services.common.metrics import WorkerMetrics
from services.common.openai_endpoint import OpenAIEndpoint, start_openai_endpoint
from services.common.registry import RegistryPublisher, WorkerInfo
from services.common.security import add_port, read_cluster_secret
from services.common.standby import StandbyWatcher
from services.common.startup import StartupClock, StartupCollector
from services.common.status_server import StatusServer
from services.common.tracing import setup_tracing, shutdown_tracing
from services.common.worker_config import WorkerConfig
from services.decode.kv_keys import RemoteKVKeys

log = logging.getLogger("splitserve.worker")


def kv_layout_of(engine: LLMEngine):
    from kv_transfer.layout import KVLayout

    runner = engine.runner
    return KVLayout(
        num_layers=engine.model_config.num_layers,
        num_kv_heads=runner.num_kv_heads,
        head_dim=engine.model_config.head_dim,
        block_size=engine.config.block_size,
        dtype=str(runner.dtype).removeprefix("torch."),
    )


GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    # The gateway pings every 10 s on a stream that sends it nothing (a decode stream):
    # allowed, never a GOAWAY "too_many_pings".
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
    # gRPC binds with SO_REUSEPORT by default: a second process on a taken port started and
    # the two shared its connections. Off, the bind fails.
    ("grpc.so_reuseport", 0),
]


class Worker:
    """One worker process. Objects here are created on the main thread; the engine runs on
    its EngineLoop thread, gRPC on the asyncio loop, KV receives on kv_transfer threads."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.startup = StartupClock.since_process_start()
        self.startup.end_phase("imports")
        weights_s, kernels_s = weight_load_seconds(), cpu_kernels.load_seconds()
        self.engine = build_engine(lambda: LLMEngine(config.engine_config()))
        self.startup.end_phase("kv_allocation", of_which={
            "weight_load": weight_load_seconds() - weights_s,
            "kernel_load": cpu_kernels.load_seconds() - kernels_s,
            "kernel_choice": getattr(self.engine.runner, "kernel_choice_seconds", 0.0),
            "memory_profile": self.engine.runner.memory.profile_seconds})
        self.engine_loop = EngineLoop(
            self.engine, max_unread_outputs=config.max_unread_outputs,
            kv_reservation_ttl_s=config.kv_reservation_ttl_s,
            step_timeout_s=config.step_timeout_s,
        )
        if config.core_share:
            if self.engine.runner.device.type == "cpu":
                self.engine_loop.core_share = CoreShare(
                    config.core_share, config.num_threads, priority=config.role == "prefill",
                    yield_share=config.core_share_yield,
                    yield_burst_s=config.core_share_yield_burst_s)
            else:
                log.warning("--core-share ignored: it lends CPU threads, and this worker "
                            "runs on %s", self.engine.runner.device)
        # Decode role: transfer key -> request id for ids too long to travel verbatim; the
        # Generate streams fill it, the KV receiver callbacks read it.
        self.kv_keys = RemoteKVKeys(vocab_size=self.engine.model_config.vocab_size)
        self.state = WorkerState(config.role, config.resolved_worker_id, config.model_name)
        self.receiver = None
        self.senders = None
        self.server: grpc.aio.Server | None = None
        self.decode_servicer = None  # decode and both roles: drain hands its streams off
        self.port = config.port
        self.metrics = WorkerMetrics(config.role, self.state.worker_id, model=config.served_name,
                                     vllm_metrics=config.vllm_metrics,
                                     max_model_len=self.engine.servable_len)
        self.metrics.attach(self.engine_loop)
        self.metrics.registry.register(MemoryCollector(self.engine.runner.memory,
                                                       config.served_name, config.role))
        self.status_server: StatusServer | None = None
        self.openai_endpoint: OpenAIEndpoint | None = None  # --openai-port: a child process
        self.registry: RegistryPublisher | None = None
        self.standby: StandbyWatcher | None = None  # --standby, until activated
        self.kv_endpoint = ""
        self.metrics_at = "-"
        # Signs registry entries (and authenticates KV channels); None: no secret configured.
        self.cluster_secret = (read_cluster_secret(config.cluster_secret_file)
                               if config.cluster_secret_file else None)
        self.rank_pids: list[int] = []
        if isinstance(self.engine.runner, TensorParallelExecutor):
            self.rank_pids = self.engine.runner.rank_pids
            self.engine.runner.on_failure = self._on_rank_failure

    async def start(self) -> None:
        from services.common.tp_kv import open_kv_receiver, open_kv_senders

        cfg = self.config
        layout = kv_layout_of(self.engine)
        device = self.engine.runner.device
        self.engine_loop.start()
        kv_endpoint = ""
        if cfg.role in ("decode", "both"):
            self.receiver = open_kv_receiver(
                self.engine, host=cfg.host, port=cfg.kv_port, layout=layout, device=device,
                on_kv=self._on_kv, timeout_s=cfg.kv_transfer_timeout_s,
                on_channel_error=self._on_channel_error,
                on_abort=self._on_kv_abort,
                # Every frame checked against its reservation before anything is allocated.
                secret=self.cluster_secret, max_blocks=self.engine.kv.num_blocks,
                check_frame=self.kv_keys.check_frame,
                on_refused=lambda header, reason: self._on_kv_abort(header),
                shared_memory=cfg.kv_shared_memory_mib > 0,
            )
            # One endpoint per tensor-parallel rank, in rank order.
            kv_endpoint = ",".join(host_port(cfg.public_host, endpoint.rsplit(":", 1)[1])
                                   for endpoint in self.receiver.endpoint.split(","))
            self.metrics.kv_stats.append(self.receiver.stats)
        if cfg.role in ("prefill", "both"):
            self.senders = open_kv_senders(self.engine, layout=layout, device=device,
                                           timeout_s=cfg.kv_transfer_timeout_s,
                                           secret=self.cluster_secret,
                                           max_senders=cfg.max_kv_senders,
                                           max_queued=cfg.max_queued_kv_transfers,
                                           shared_memory_bytes=cfg.kv_shared_memory_bytes)
            self.metrics.kv_stats.append(self.senders.stats)

        from services.decode.servicer import DecodeServicer
        from services.prefill.kv_endpoints import KVEndpointPolicy
        from services.prefill.servicer import PrefillServicer

        self.server = grpc.aio.server(options=GRPC_OPTIONS)
        if cfg.role in ("prefill", "both"):
            endpoints = KVEndpointPolicy(cfg.kv_allowed_endpoints, cfg.redis_url,
                                         self.cluster_secret, local_hosts=(cfg.public_host,))
            add_servicer(prefill_pb2_grpc.add_PrefillServicer_to_server,
                         PrefillServicer(self.engine_loop, self.senders, cfg.model_name,
                                         self.state, endpoints), self.server)
        if cfg.role in ("decode", "both"):
            self.decode_servicer = DecodeServicer(self.engine_loop, kv_endpoint, self.state,
                                                  cfg.kv_wait_timeout_s, kv_keys=self.kv_keys)
            add_servicer(decode_pb2_grpc.add_DecodeServicer_to_server, self.decode_servicer,
                         self.server)
        # With TLS files only the mutual-TLS port exists: a plaintext peer cannot even speak.
        try:
            self.port = add_port(self.server, host_port(cfg.host, cfg.port), cfg.tls)
        except RuntimeError:  # grpc's "Failed to bind": taken since _check_ports_free
            self.port = 0
        if self.port == 0:
            raise SystemExit(f"splitserve worker: --port {cfg.port} on {cfg.host} cannot be "
                             "bound: another process holds it?")
        if not (cfg.tls is not None and cfg.tls.enabled) and not is_loopback(cfg.host):
            log.warning(
                "the worker's gRPC port %s serves without TLS on an address other hosts may "
                "reach: anyone who reaches it can run requests past the gateway's API keys and "
                "quotas (set --tls-cert, --tls-key and --tls-ca; the Helm chart does)",
                host_port(cfg.host, self.port))
        if not cfg.worker_id:
            # Derived from the bound port, so workers started with --port 0 stay distinct.
            self.state.worker_id = f"{cfg.role}-{socket.gethostname()}-{self.port}"
        await self.server.start()
        metrics_at = "-"
        if cfg.metrics_port >= 0:
            self.status_server = StatusServer(
                cfg.host, cfg.metrics_port, self.metrics.registry,
                # A dead OpenAI endpoint child fails liveness: the port it served is gone.
                is_live=lambda: self.engine_loop.live and (
                    self.openai_endpoint is None or self.openai_endpoint.healthy),
                is_ready=lambda: self.engine_loop.ready and not self.state.draining,
            )
            self.status_server.start()
            metrics_at = host_port(cfg.public_host, self.status_server.port)
        self.kv_endpoint = kv_endpoint
        self.metrics_at = metrics_at
        if cfg.openai_port:
            self.openai_endpoint = start_openai_endpoint(
                cfg, self.port, self.status_server.port if self.status_server else None)
        if cfg.redis_url:
            self.registry = RegistryPublisher(
                cfg.redis_url, self.describe, self._drain_prefix_events,
                ttl_s=cfg.heartbeat_ttl_s, interval_s=max(cfg.heartbeat_ttl_s / 5, 0.2),
                secret=self.cluster_secret,
            )
            if cfg.standby:
                self.standby = StandbyWatcher(cfg.redis_url, self.describe, self._join,
                                              ttl_s=cfg.heartbeat_ttl_s,
                                              secret=self.cluster_secret)
                await self.standby.start()
            else:
                await self._join()
        self.startup.end_phase("serving")
        self.metrics.registry.register(StartupCollector(self.startup, cfg.role, cfg.served_name))
        log.info(
            "worker ready role=%s id=%s grpc=%s:%d tls=%s kv_endpoint=%s kv_blocks=%d dtype=%s %s",
            cfg.role, self.state.worker_id, cfg.host, self.port, cfg.tls.describe(),
            kv_endpoint or "-", self.engine.kv.num_blocks, self.engine.runner.dtype,
            self.startup.describe(),
        )
        # What start-up allocated (the model's modules, torch's, gRPC's and the tokenizer's
        # objects) lives as long as the process. Out of the collector's sight, a full
        # collection no longer walks it in the middle of a step (tens of milliseconds).
        gc.freeze()
        log.info("start-up objects out of the garbage collector's sight (gc.freeze): %d",
                 gc.get_freeze_count())
        # A line launchers and tests wait for.
        ranks = f" tp_pids={','.join(map(str, self.rank_pids))}" if self.rank_pids else ""
        standby = " standby=1" if cfg.standby else ""
        print(f"SPLITSERVE_READY {cfg.role} {host_port(cfg.host, self.port)} metrics={metrics_at} "
              f"kv={kv_endpoint}{ranks}{standby} {self.startup.describe()}", flush=True)

    async def _join(self) -> None:
        """Enter the registry: at start, or when a standby worker is activated (then the
        first entry is written before this returns, so gateways see it at their next look)."""
        self.engine.kv.pool.record_events = True
        if self.standby is not None:
            await self.registry.publish_once()
            log.info("activated: in the registry after standing by")
        self.registry.start()

    def describe(self) -> WorkerInfo:
        """This worker as the registry shows it (called on the event loop; reads snapshots)."""
        cfg = self.config
        return WorkerInfo(
            worker_id=self.state.worker_id, role=cfg.role,
            address=host_port(cfg.public_host, self.port), kv_endpoint=self.kv_endpoint,
            model=cfg.model_name, block_size=cfg.block_size,
            max_model_len=self.engine.servable_len,
            metrics_address=self.metrics_at if self.metrics_at != "-" else "",
            draining=self.state.draining or not self.engine_loop.ready,
            # startup_s: the autoscaler plans its horizon from it (without --startup-s).
            stats={**self.engine_loop.stats, "startup_s": round(self.startup.total_s, 3)},
        )

    def _drain_prefix_events(self) -> list[tuple[str, int]]:
        events = self.engine.kv.pool.events
        drained = []
        while events:
            drained.append(events.popleft())
        return drained

    def _on_kv(self, header, payload) -> None:
        # kv_transfer receiver thread: hand over to the engine thread, never touch the engine.
        self.engine_loop.receive_remote_kv(
            self.kv_keys.request_id(header.request_key), header.first_token, payload,
            release=self.receiver.release,
        )

    def _on_kv_abort(self, header) -> None:
        # kv_transfer receiver thread: the prefill worker says this KV will not come.
        rid = self.kv_keys.request_id(header.request_key)
        self.engine_loop.submit(lambda engine: engine.remote.recompute_locally(rid))

    def _on_channel_error(self, peer, exc) -> None:
        # A prefill peer died. Requests still waiting for KV may have been on it: recompute
        # them here (KV that arrives later from a healthy peer is then dropped harmlessly).
        log.warning("KV channel to %s failed (%s); recomputing requests waiting for KV", peer, exc)

        def recompute_all(engine: LLMEngine) -> None:
            for rid in list(engine.scheduler.waiting_for_kv):
                engine.remote.recompute_locally(rid)

        self.engine_loop.submit(recompute_all)

    def _on_rank_failure(self, reason: str) -> None:
        # Executor monitor thread. The worker cannot run another step: report unhealthy and
        # stop, as when the engine loop crashes (its streams end with an error).
        log.error("tensor-parallel rank failure (%s); worker is unhealthy and exits", reason)
        self.engine_loop.healthy = False
        if self.engine_loop.on_crash is not None:
            self.engine_loop.on_crash()

    async def drain_and_stop(self, grace_s: float) -> None:
        """Stop taking work, finish what is held (up to grace_s), hand the streams still
        open to the gateway for migration (they end with a status that says so), then shut
        down. So a drain cuts no stream, however long its generation."""
        self.state.draining = True
        if self.openai_endpoint is not None:  # no new HTTP requests; open ones finish
            self.openai_endpoint.drain()
        if self.standby is not None:
            await self.standby.close()
        if self.registry is not None:
            await self.registry.deregister(self.state.worker_id)
        deadline = time.monotonic() + grace_s
        while self.engine.has_unfinished() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.decode_servicer is not None and self.engine_loop.healthy:
            handed_off = self.decode_servicer.hand_off()
            if handed_off:
                log.info("drain grace over: %d streams handed off for migration", handed_off)
            # The streams end on the event loop; give their last messages a moment to leave.
            hand_off_deadline = time.monotonic() + 2.0
            while self.decode_servicer.num_open_streams and time.monotonic() < hand_off_deadline:
                await asyncio.sleep(0.02)
        if self.server is not None:
            await self.server.stop(1.0)
        self.close()

    def close(self) -> None:
        if self.openai_endpoint is not None:
            self.openai_endpoint.close()
        if self.status_server is not None:
            self.status_server.close()
        self.engine_loop.stop()
        if self.receiver is not None:
            self.receiver.close()
        if self.senders is not None:
            self.senders.close()
        self.engine.close()


async def _serve(config: WorkerConfig) -> int:
    worker = Worker(config)
    await worker.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    worker.engine_loop.on_crash = lambda: loop.call_soon_threadsafe(stop.set)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if not worker.engine_loop.healthy:
        await worker.drain_and_stop(0)
        return 1
    log.info("draining (grace %.0fs)", config.drain_grace_s)
    await worker.drain_and_stop(config.drain_grace_s)
    return 0


def run_worker(config: WorkerConfig) -> int:
    setup_logging(config.role, config.log_level, config.log_format)
    setup_tracing(f"splitserve-{config.role}")
    log.info("config %s", config.describe())
    _check_ports_free(config)
    try:
        return asyncio.run(_serve(config))
    except KVPoolTooSmall as exc:
        # Refused with the numbers, not a traceback: this configuration cannot serve a request.
        log.error("refusing to start: %s", exc)
        raise SystemExit(f"splitserve worker: {exc}") from None
    finally:
        shutdown_tracing()


def _check_ports_free(config: WorkerConfig) -> None:
    """A fixed port another process holds, refused before the model loads: it was a traceback
    from gRPC (or the metrics server) after the whole start-up, 6-15 s (a CLI audit)."""
    check_ports_free("splitserve worker", [
        (flag, config.host, port) for flag, port in (
            ("--port", config.port), ("--metrics-port", config.metrics_port),
            ("--kv-port", config.kv_port))])
