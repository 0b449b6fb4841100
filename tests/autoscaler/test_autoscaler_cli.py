"""The `splitserve autoscaler`, `profile` and `capacity plan` command lines: the flags the Helm
chart passes parse, bad settings fail with one clear line, and the process serves /health,
/ready and /metrics on SPLITSERVE_AUTOSCALER_PORT and stops cleanly on SIGTERM."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from services.autoscaler.config import (
    DEFAULT_PROFILE,
    add_autoscaler_arguments,
    autoscaler_config_from_args,
)
from services.autoscaler.profile import HardwareProfile
from splitserve_cli.main import main
from splitserve_cli.processes import free_port


def parse(argv: list[str], env: dict | None = None):
    old = dict(os.environ)
    os.environ.update(env or {})
    try:
        parser = argparse.ArgumentParser()
        add_autoscaler_arguments(parser)
        return autoscaler_config_from_args(parser.parse_args(argv))
    finally:
        os.environ.clear()
        os.environ.update(old)


def test_the_charts_arguments_and_environment_parse():
    chart = pytest.importorskip("tests.k8s.chart_render")
    deployment = chart.render_scenario("default").get("Deployment", "demo-splitserve-autoscaler")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][0] == "autoscaler"
    env = {e["name"]: e.get("value", "x") for e in container["env"]}
    env.update(REDIS_URL="redis://redis:6379/0", POD_NAMESPACE="llm")  # from secrets / fieldRefs
    # Kubernetes expands $(VAR) in args from the container's environment.
    argv = [env.get(a[2:-1], a) if a.startswith("$(") else a for a in container["args"][1:]]
    config = parse(argv, env={k: v for k, v in env.items() if k.startswith(("SPLITSERVE_", "REDIS"))})
    assert config.actuator == "k8s" and config.namespace == "llm"
    assert config.prefill_deployment == "demo-splitserve-prefill"
    assert config.decode_deployment == "demo-splitserve-decode"
    assert config.port == int(env["SPLITSERVE_AUTOSCALER_PORT"]) == 9100
    probes = (container["livenessProbe"]["httpGet"]["path"], container["readinessProbe"]["httpGet"]["path"])
    assert probes == ("/health", "/ready")


@pytest.mark.parametrize("argv, message", [
    ([], "--redis-url"),
    (["--redis-url", "redis://x", "--actuator", "k8s"], "--prefill-deployment"),
    (["--redis-url", "redis://x", "--actuator", "magic"], "--actuator"),
    (["--redis-url", "redis://x", "--profile", "/nonexistent.json"], "splitserve profile"),
    (["--redis-url", "redis://x", "--length-mix", "12"], "prompt:output"),
    (["--redis-url", "redis://x", "--min-decode-replicas", "4", "--max-decode-replicas", "2"], "min"),
])
def test_bad_settings_fail_with_one_line(argv, message):
    with pytest.raises(SystemExit, match=message):
        parse(argv, env={"REDIS_URL": ""})


def test_the_bundled_default_profile_loads():
    profile = HardwareProfile.load(DEFAULT_PROFILE)
    assert profile.kv_blocks > 0 and profile.startup_s > 0


def test_capacity_plan_prints_workers_per_role(tmp_path, capsys, profile):
    profile.save(tmp_path / "p.json")
    assert main(["capacity", "plan", "--profile", str(tmp_path / "p.json"), "--rate", "10",
                 "--length-mix", "256:64:0.8,1024:256:0.2", "--ttft-s", "1", "--itl-s", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "prefill:" in out and "decode:" in out and "1 spare worker(s) per role" in out


def test_autoscaler_process_serves_probes_and_stops_on_sigterm(redis_server):
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "splitserve_cli.main", "autoscaler", "--redis-url", redis_server,
         "--actuator", "dry-run", "--host", "127.0.0.1", "--interval-s", "0.5", "--log-format", "text"],
        env={**os.environ, "SPLITSERVE_AUTOSCALER_PORT": str(port)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def get(path: str) -> tuple[int, str]:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as reply:
                    return reply.status, reply.read().decode()
            except urllib.error.HTTPError as exc:
                return exc.code, ""

        deadline = time.monotonic() + 30
        while True:
            try:
                if get("/ready")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline and process.poll() is None, "autoscaler never ready"
            time.sleep(0.2)
        assert get("/health")[0] == 200
        status, text = get("/metrics")
        assert status == 200 and 'splitserve_autoscaler_desired_replicas{role="decode"} 1.0' in text
        process.send_signal(signal.SIGTERM)
        assert process.wait(20) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(5)


def test_the_shipped_planner_settings_are_the_simulated_ones():
    """`splitserve autoscaler` without tuning flags plans as bench/autoscaler_sim.py and
    tests/autoscaler/test_simulator.py measured it (PlannerConfig's defaults); the scale-down
    cooldown once shipped at 30 s against a simulated 15 s."""
    from services.autoscaler.planner import PlannerConfig

    shipped, simulated = parse(["--redis-url", "redis://x:6379/0"]).planner_config(), PlannerConfig()
    for knob in ("interval_s", "scale_down_window_s", "scale_down_cooldown_s",
                 "scale_up_cooldown_s", "hysteresis", "backlog_drain_s"):
        assert getattr(shipped, knob) == getattr(simulated, knob), knob
