"""The autoscaler reads its hardware profile from the chart's ConfigMap: the chart is rendered with
a profile inline, the ConfigMap's file is laid out on disk exactly as the kubelet mounts it
(`<mount>/<key>` -> `..data/<key>`, `..data` -> a timestamped folder), and a real
`splitserve autoscaler --actuator local` started with the chart's --profile and --startup-s plans
from that profile: the capacity per replica on its /metrics is the one this profile gives, not
the bundled CPU profile's."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from services.autoscaler.actuators import DryRunActuator
from services.autoscaler.config import DEFAULT_PROFILE
from services.autoscaler.control_loop import Autoscaler
from services.autoscaler.planner import Planner
from services.autoscaler.profile import HardwareProfile
from services.autoscaler.sources import RegistrySource
from splitserve_cli.processes import free_port
from tests.autoscaler.sample_profiles import make_profile
from tests.autoscaler.test_autoscaler_cli import parse

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

chart = pytest.importorskip("tests.k8s.chart_render")
CAPACITY = "splitserve_autoscaler_replica_capacity_tokens_per_second"


def mount_like_the_kubelet(root: Path, mount_path: str, files: dict[str, str]) -> Path:
    """A configMap volume's layout: the data in a timestamped folder, `..data` pointing at it,
    and each key a symlink through `..data` (how the kubelet swaps an update in atomically)."""
    mount = root / mount_path.lstrip("/")
    stamp = mount / "..2026_12_01_16_00_00.123456789"
    stamp.mkdir(parents=True)
    for key, text in files.items():
        (stamp / key).write_text(text)
    (mount / "..data").symlink_to(stamp.name)
    for key in files:
        (mount / key).symlink_to(f"..data/{key}")
    return mount


def rendered_autoscaler(profile_json: str) -> tuple[dict, dict, dict]:
    rendered = chart.render({"autoscaler": {"profile": {"inline": profile_json},
                                            "startupSeconds": 45}})
    deployment = rendered.get("Deployment", "demo-splitserve-autoscaler")
    pod = deployment["spec"]["template"]["spec"]
    configmap = rendered.get("ConfigMap", "demo-splitserve-autoscaler-profile")
    return pod, pod["containers"][0], configmap


def scrape_capacity(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as reply:
        text = reply.read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith(CAPACITY + "{"):
            role = line.split('role="')[1].split('"')[0]
            values[role] = float(line.rsplit(" ", 1)[1])
    return values


def expected_capacity(profile_path: Path, argv: list[str], redis_url: str) -> dict[str, float]:
    """What one planner iteration with no load gives per replica, computed in this process."""
    config = parse(["--redis-url", redis_url, "--actuator", "dry-run", *argv])
    planner = Planner(HardwareProfile.load(profile_path), config.planner_config())
    loop = Autoscaler(RegistrySource(redis_url), planner, DryRunActuator({"prefill": 1, "decode": 1}))
    decision = loop.tick(time.time())
    return {role: decision.role(role).per_replica for role in ("prefill", "decode")}


def test_the_local_autoscaler_plans_from_a_profile_mounted_like_the_configmap(
        tmp_path, redis_server, tiny_llama_dir):
    profile = make_profile(model="Llama-3.1-8B-on-H100", device="cuda", host="gpu-node-1")
    pod, container, configmap = rendered_autoscaler(profile.to_json())
    args = container["args"]
    profile_arg = args[args.index("--profile") + 1]
    (mount,) = [m for m in container["volumeMounts"] if profile_arg.startswith(m["mountPath"] + "/")]
    volume = {v["name"]: v for v in pod["volumes"]}[mount["name"]]
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
    assert args[args.index("--startup-s") + 1] == "45"

    mounted = mount_like_the_kubelet(tmp_path, mount["mountPath"], configmap["data"])
    profile_path = tmp_path / profile_arg.lstrip("/")
    assert profile_path.is_symlink() and profile_path.parent == mounted
    chart_flags = ["--profile", str(profile_path), "--startup-s", "45"]

    expected = expected_capacity(profile_path, chart_flags, redis_server)
    bundled = expected_capacity(DEFAULT_PROFILE, ["--startup-s", "45"], redis_server)
    assert expected != bundled  # the check below can tell the two profiles apart

    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "splitserve_cli.main", "autoscaler", "--redis-url", redis_server,
         "--actuator", "local", "--model", str(tiny_llama_dir), "--host", "127.0.0.1",
         "--interval-s", "0.5", "--log-format", "text", "--max-prefill-replicas", "1",
         "--max-decode-replicas", "1",
         "--prefill-args=--num-kv-blocks 64 --metrics-port -1",
         "--decode-args=--num-kv-blocks 64 --metrics-port -1", *chart_flags],
        env={**os.environ, "SPLITSERVE_AUTOSCALER_PORT": str(port)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        seen: dict[str, float] = {}
        while set(seen) != {"prefill", "decode"}:
            assert process.poll() is None and time.monotonic() < deadline, "no capacity exported"
            try:
                seen = scrape_capacity(port)
            except OSError:
                pass
            time.sleep(0.3)
        assert seen == pytest.approx(expected)
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=60)
    assert process.returncode == 0, output[-3000:]
    assert f"profile {profile_path}: Llama-3.1-8B-on-H100 on cuda (gpu-node-1)" in output
    assert "worker start-up 45.0 s" in output
    assert "no --profile" not in output
