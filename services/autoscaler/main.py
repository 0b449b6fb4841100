"""`splitserve autoscaler`: the control loop as a process, with /health, /ready and /metrics
on SPLITSERVE_AUTOSCALER_PORT (9100), as the Helm chart runs it."""

from __future__ import annotations

import argparse
import logging
import shlex
import signal
import threading

from services.autoscaler.config import (
    AutoscalerConfig,
    add_autoscaler_arguments,
    autoscaler_config_from_args,
)
from services.common.addresses import host_port

log = logging.getLogger("splitserve.autoscaler")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_autoscaler_arguments(parser)


def build(config: AutoscalerConfig):
    """(Autoscaler, its Actuator) from a config; no thread started, nothing scaled yet."""
    from services.autoscaler.actuators import DryRunActuator, KubernetesActuator
    from services.autoscaler.control_loop import Autoscaler, AutoscalerMetrics
    from services.autoscaler.planner import Planner
    from services.autoscaler.profile import HardwareProfile
    from services.autoscaler.sources import PrometheusSource, RegistrySource

    profile = HardwareProfile.load(config.profile_path)
    startup = (f"{config.startup_s:.1f} s (--startup-s)" if config.startup_s >= 0 else
               f"the workers' measured, {profile.startup_s:.1f} s (profile) until one reports")
    log.info("profile %s: %s on %s (%s), worker start-up %s", config.profile_path,
             profile.model, profile.device, profile.host, startup)
    if not config.profile:
        log.warning("no --profile: using the bundled %s profile (%s, %s); capacity numbers are "
                    "only right on that hardware", profile.model, profile.device, profile.host)
    secret = None
    if config.cluster_secret_file:
        from services.common.security import read_cluster_secret

        secret = read_cluster_secret(config.cluster_secret_file)
    registry = RegistrySource(config.redis_url, secret)
    source = registry if config.source == "registry" else PrometheusSource(registry)
    if config.actuator == "k8s":
        actuator = KubernetesActuator(config.namespace, {"prefill": config.prefill_deployment,
                                                         "decode": config.decode_deployment})
    elif config.actuator == "local":
        from services.autoscaler.local_actuator import LocalActuator

        actuator = LocalActuator(config.model, config.redis_url, {
            "prefill": shlex.split(config.prefill_args), "decode": shlex.split(config.decode_args)},
            warm_pool={"prefill": config.warm_pool_prefill, "decode": config.warm_pool_decode})
    else:
        actuator = DryRunActuator({"prefill": config.min_prefill_replicas,
                                   "decode": config.min_decode_replicas})
    planner = Planner(profile, config.planner_config())
    return Autoscaler(source, planner, actuator, AutoscalerMetrics()), actuator


def run(args: argparse.Namespace) -> int:
    from services.common.logs import setup_logging
    from services.common.status_server import StatusServer

    config = autoscaler_config_from_args(args)
    setup_logging("autoscaler", config.log_level, config.log_format)
    log.info("config %s", config.describe())
    try:
        autoscaler, actuator = build(config)
    except ValueError as exc:
        raise SystemExit(f"splitserve autoscaler: {exc}") from None
    stop = threading.Event()
    loop = threading.Thread(target=autoscaler.run, args=(stop, config.interval_s),
                            name="autoscaler-loop", daemon=True)
    status = StatusServer(config.host, config.port, autoscaler.metrics.registry,
                          is_live=loop.is_alive,
                          is_ready=lambda: autoscaler.ready(config.interval_s))
    status.start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    loop.start()
    print(f"SPLITSERVE_READY autoscaler {host_port(config.host, status.port)} actuator={config.actuator}",
          flush=True)
    while not stop.wait(1.0):
        pass
    loop.join(config.interval_s + 10)
    log.info("stopping")
    actuator.close()  # local: drains the workers it started; k8s: leaves the Deployments as they are
    status.close()
    return 0
