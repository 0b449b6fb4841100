"""The settings the chart passes to each process are ones that process reads: every SPLITSERVE_*
variable and flag on a worker or gateway pod maps to an option of its command line, except the
few the chart is ahead on (PENDING), which their processes are still growing."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from chart_render import RELEASE, SCENARIOS, render, render_scenario, worker_deployments

FULLNAME = f"{RELEASE}-splitserve"
# Interfaces the chart is designed for but the process does not read yet (drop them when it does).
PENDING = {
    "gateway": {"REDIS_URL"},
    "worker": set(),
}


def worker_parser() -> argparse.ArgumentParser:
    from services.common.worker_cli import add_worker_arguments

    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, role=None)
    return parser


def worker_env_names() -> set[str]:
    actions = [a for a in worker_parser()._actions if a.dest != "help"]
    # REDIS_URL is the worker's own fallback for --redis-url.
    return {f"SPLITSERVE_{a.dest.upper()}" for a in actions} | {"REDIS_URL"}


def gateway_env_names() -> set[str]:
    from services.gateway.config import GatewayConfig, _env_name

    return {_env_name(f.name) for f in dataclasses.fields(GatewayConfig)}


def chart_settings(container: dict) -> set[str]:
    return {e["name"] for e in container["env"]
            if e["name"].startswith("SPLITSERVE_") or e["name"] == "REDIS_URL"}


def container(scenario: str, component: str) -> dict:
    deployment = render_scenario(scenario).get("Deployment", f"{FULLNAME}-{component}")
    return deployment["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_worker_settings_are_worker_options(scenario: str) -> None:
    known = worker_env_names()
    for name, role in worker_deployments(render_scenario(scenario)).items():
        worker = render_scenario(scenario).get("Deployment", name)["spec"]["template"]["spec"][
            "containers"][0]
        assert chart_settings(worker) - known <= PENDING["worker"], role
        parsed = worker_parser().parse_args(worker["args"][1:])
        assert parsed.role == role


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_gateway_settings_are_gateway_options(scenario: str) -> None:
    unknown = chart_settings(container(scenario, "gateway")) - gateway_env_names()
    assert unknown <= PENDING["gateway"]


def test_worker_env_values_parse_as_the_worker_would() -> None:
    # Rendered values must survive the worker's own int()/float() conversions.
    worker = container("default", "decode")
    env = {e["name"]: e.get("value") for e in worker["env"]}
    for name in ("SPLITSERVE_PORT", "SPLITSERVE_KV_PORT", "SPLITSERVE_METRICS_PORT",
                 "SPLITSERVE_BLOCK_SIZE"):
        int(env[name])
    float(env["SPLITSERVE_DRAIN_GRACE_S"])
    from services.common.worker_config import kv_cache_bytes

    # auto, as the worker's own default: the pool is what the GPU has left at 90% of it (a
    # fixed 8GiB left about 50 GB of an 80 GB GPU idle under an 8B model).
    assert kv_cache_bytes(env["SPLITSERVE_KV_CACHE_MEMORY"]) == 0
    assert float(env["SPLITSERVE_GPU_MEMORY_UTILIZATION"]) == 0.9
    sized = render({"decode": {"kvCacheMemory": "48GiB", "gpuMemoryUtilization": 0.8}})
    pod = sized.get("Deployment", f"{RELEASE}-splitserve-decode")["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert kv_cache_bytes(env["SPLITSERVE_KV_CACHE_MEMORY"]) == 48 * 2**30
    assert float(env["SPLITSERVE_GPU_MEMORY_UTILIZATION"]) == 0.8


@pytest.mark.parametrize("listen_host", ["0.0.0.0", "::"])
def test_listen_host_reaches_every_process(listen_host: str) -> None:
    """`listenHost: "::"` for IPv6-only clusters: every process listens there (0.0.0.0 would
    listen on IPv4 alone); workers still advertise their pod IP."""
    from chart_render import render

    rendered = render({"listenHost": listen_host})

    def env(component: str) -> dict[str, str | None]:
        deployment = rendered.get("Deployment", f"{FULLNAME}-{component}")
        return {e["name"]: e.get("value")
                for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}

    gateway = env("gateway")
    assert gateway["SPLITSERVE_GATEWAY_HOST"] == gateway["SPLITSERVE_GATEWAY_ADMIN_HOST"] == listen_host
    for role in ("prefill", "decode"):
        assert env(role)["SPLITSERVE_HOST"] == listen_host
        assert env(role)["SPLITSERVE_ADVERTISE_HOST"] == "$(POD_IP)"
    assert env("autoscaler")["SPLITSERVE_AUTOSCALER_HOST"] == listen_host


@pytest.mark.parametrize("mode", ["disaggregated", "aggregated"])
def test_the_served_model_name_reaches_the_gateway_and_every_worker(mode: str) -> None:
    """model.servedName: the one name clients send, the same on every process (the gateway's
    "model", the workers' OpenAI port and metrics labels; their registry identity stays the
    folder's name, by which model versions pair during an update)."""
    name = "meta-llama/Llama-3.1-8B-Instruct"
    values = {"mode": mode, "model": {"servedName": name}}
    if mode == "aggregated":
        values["autoscaler"] = {"enabled": False}
    rendered = render(values)

    def env(deployment: str) -> dict[str, str | None]:
        pod = rendered.get("Deployment", deployment)["spec"]["template"]["spec"]
        return {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}

    assert env(f"{FULLNAME}-gateway")["SPLITSERVE_GATEWAY_SERVED_MODEL_NAME"] == name
    workers = worker_deployments(rendered)
    assert workers
    for deployment in workers:
        assert env(deployment)["SPLITSERVE_SERVED_MODEL_NAME"] == name
    assert f'"model": "{name}"' in rendered.notes
    default = render({})
    assert "SPLITSERVE_GATEWAY_SERVED_MODEL_NAME" not in {
        e["name"] for e in default.get("Deployment", f"{FULLNAME}-gateway")["spec"]["template"][
            "spec"]["containers"][0]["env"]}
    assert '"model": "smollm2-135m-instruct"' in default.notes
