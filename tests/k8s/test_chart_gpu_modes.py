"""The chart's GPU deployment shapes: mode disaggregated or aggregated, tensor parallelism checked
against GPUs per pod at render time, the rdma block on exactly the workers that move KV, and the
per-pool blocks (securityContext, runtimeClassName, extra env/volumes, init containers, /dev/shm).
Strict schema, kubernetes-validate, helm lint and checkov run over the ci/gpu-* examples in the
other modules of this folder; this one checks what each block renders and refuses."""

from __future__ import annotations

import helm_python as helm
import pytest
from chart_render import CHART_DIR, RELEASE, SCENARIOS, render, render_scenario, worker_deployments

FULLNAME = f"{RELEASE}-splitserve"
AGGREGATED = {"mode": "aggregated", "autoscaler": {"enabled": False}}


def pod_spec(rendered, component: str) -> dict:
    return rendered.get("Deployment", f"{FULLNAME}-{component}")["spec"]["template"]["spec"]


def worker_container(rendered, component: str) -> dict:
    return pod_spec(rendered, component)["containers"][0]


def env(container: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in container["env"]}


def render_error(values: dict) -> str:
    with pytest.raises(helm.HelmError) as caught:
        render(values)
    return str(caught.value)


def test_aggregated_mode_runs_one_role_both_pool_and_no_prefill() -> None:
    rendered = render({**AGGREGATED, "aggregated": {"replicas": 3}})
    assert worker_deployments(rendered) == {f"{FULLNAME}-worker": "both"}
    names = {o["metadata"]["name"] for o in rendered.objects}
    assert not {n for n in names if n.endswith(("-prefill", "-decode"))}
    container = worker_container(rendered, "worker")
    assert container["args"] == ["worker", "--role", "both"]
    # No KV crosses pods: no rendezvous port.
    assert {p["name"] for p in container["ports"]} == {"grpc", "metrics"}
    deployment = rendered.get("Deployment", f"{FULLNAME}-worker")
    assert deployment["spec"]["replicas"] == 3


@pytest.mark.parametrize("scaler", ["hpa", "keda"])
def test_aggregated_pool_scales_on_the_decode_settings(scaler: str) -> None:
    rendered = render({**AGGREGATED, scaler: {"enabled": True}})
    kind = "HorizontalPodAutoscaler" if scaler == "hpa" else "ScaledObject"
    (obj,) = rendered.of_kind(kind)
    assert obj["spec"]["scaleTargetRef"]["name"] == f"{FULLNAME}-worker"
    assert "splitserve_kv_usage_ratio" in str(obj) or "splitserve_kv_blocks_used" in str(obj)


def test_aggregated_refuses_the_builtin_autoscaler_and_rdma() -> None:
    message = render_error({"mode": "aggregated"})
    assert "built-in autoscaler cannot size" in message and "autoscaler.enabled=false" in message
    message = render_error({**AGGREGATED, "rdma": {"enabled": True}})
    assert "set rdma.enabled=false" in message


def test_tensor_parallel_size_follows_gpus_or_must_equal_them() -> None:
    rendered = render({"decode": {"gpus": 4}, "prefill": {"gpus": 4, "tensorParallelSize": 4}})
    assert env(worker_container(rendered, "decode"))["SPLITSERVE_TENSOR_PARALLEL_SIZE"] == "4"
    assert env(worker_container(rendered, "prefill"))["SPLITSERVE_TENSOR_PARALLEL_SIZE"] == "4"
    message = render_error({"decode": {"gpus": 2, "tensorParallelSize": 1}})
    assert "decode.tensorParallelSize=1 but decode.gpus=2" in message
    message = render_error({**AGGREGATED, "aggregated": {"gpus": 8, "tensorParallelSize": 4}})
    assert "aggregated.tensorParallelSize=4 but aggregated.gpus=8" in message


def test_rdma_reaches_only_the_workers_that_move_kv() -> None:
    rendered = render({"rdma": {"enabled": True, "resourceName": "rdma/ib", "devicesPerPod": 2}})
    for role in ("prefill", "decode"):
        container = worker_container(rendered, role)
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"],
                                                                "add": ["IPC_LOCK"]}
        assert container["resources"]["limits"]["rdma/ib"] == 2
        assert container["resources"]["requests"]["rdma/ib"] == 2
        assert env(container)["NCCL_IB_DISABLE"] == "0"
        assert env(container)["NCCL_SOCKET_IFNAME"] == "eth0"
    for component in ("gateway", "autoscaler"):
        container = worker_container(rendered, component)
        assert "add" not in container["securityContext"]["capabilities"]
        assert "rdma/ib" not in str(container["resources"])
        assert not any(name.startswith("NCCL_") for name in env(container))
    plain = render({})
    for role in ("prefill", "decode"):
        container = worker_container(plain, role)
        assert "add" not in container["securityContext"]["capabilities"]
        assert not any(name.startswith("NCCL_") for name in env(container))


def test_per_pool_blocks_land_on_their_pool_only() -> None:
    init = {"name": "fetch", "image": "busybox@sha256:" + "0" * 64, "command": ["true"]}
    values = {"decode": {
        "securityContext": {"runAsUser": 20002},
        "runtimeClassName": "nvidia",
        "initContainers": [init],
        "extraVolumes": [{"name": "cache", "emptyDir": {}}],
        "extraVolumeMounts": [{"name": "cache", "mountPath": "/cache"}],
        "extraEnv": [{"name": "HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}}],
        "shmSize": "16Gi",
    }}
    rendered = render(values)
    decode, prefill = pod_spec(rendered, "decode"), pod_spec(rendered, "prefill")
    context = decode["containers"][0]["securityContext"]
    assert context["runAsUser"] == 20002 and context["capabilities"] == {"drop": ["ALL"]}
    assert context["readOnlyRootFilesystem"] is True  # merged over the shared one, not replaced
    assert decode["runtimeClassName"] == "nvidia" and decode["initContainers"] == [init]
    assert {"name": "cache", "emptyDir": {}} in decode["volumes"]
    assert {"name": "cache", "mountPath": "/cache"} in decode["containers"][0]["volumeMounts"]
    host_ip = [e for e in decode["containers"][0]["env"] if e["name"] == "HOST_IP"]
    assert host_ip == values["decode"]["extraEnv"]
    shm = {v["name"]: v for v in decode["volumes"]}["dshm"]["emptyDir"]
    assert shm == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert {v["name"]: v for v in prefill["volumes"]}["dshm"]["emptyDir"]["sizeLimit"] == "2Gi"
    assert prefill["containers"][0]["securityContext"]["runAsUser"] == 10001
    for key in ("runtimeClassName", "initContainers"):
        assert key not in prefill
    assert "cache" not in {v["name"] for v in prefill["volumes"]}


@pytest.mark.parametrize(
    "values, where",
    [
        ({"mode": "split"}, "/mode"),
        ({"decode": {"tensorParallelSize": -1}}, "/decode/tensorParallelSize"),
        ({"prefill": {"extraVolumes": [{"emptyDir": {}}]}}, "/prefill/extraVolumes/0"),
        ({"decode": {"initContainers": [{"name": "x"}]}}, "/decode/initContainers/0"),
        ({"rdma": {"enable": True}}, "/rdma"),
        ({"aggregated": {"shmSize": "lots"}}, "/aggregated/shmSize"),
        ({"hpa": {"decode": {"metric": {"name": "m", "target": {"type": "Value", "value": "1"}}}}},
         "/hpa/decode/metric/target"),
    ],
)
def test_schema_rejects_bad_gpu_values_and_names_the_key(values: dict, where: str) -> None:
    with helm.Chart.load(CHART_DIR) as chart, pytest.raises(helm.HelmValuesError) as caught:
        chart.validate_schema(values)
    assert where in str(caught.value)


@pytest.mark.parametrize("scenario", ["gpu-disaggregated-rdma", "gpu-disaggregated-tcp",
                                      "gpu-aggregated"])
def test_gpu_examples_fill_eight_gpus_behind_a_gateway_pair(scenario: str) -> None:
    rendered = render_scenario(scenario)
    assert rendered.get("Deployment", f"{FULLNAME}-gateway")["spec"]["replicas"] == 2
    total = 0
    for name in worker_deployments(rendered):
        deployment = rendered.get("Deployment", name)
        component = name.removeprefix(f"{FULLNAME}-")
        values = SCENARIOS[scenario]["aggregated" if component == "worker" else component]
        replicas = deployment["spec"].get("replicas", values["replicas"])
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        gpus = container["resources"]["limits"]["nvidia.com/gpu"]
        assert env(container)["SPLITSERVE_TENSOR_PARALLEL_SIZE"] == str(gpus)
        total += replicas * gpus
    assert total == 8
    rdma = SCENARIOS[scenario].get("rdma", {}).get("enabled", False)
    capabilities = [worker_container(rendered, n.removeprefix(f"{FULLNAME}-"))["securityContext"]
                    ["capabilities"].get("add") for n in worker_deployments(rendered)]
    assert capabilities == [["IPC_LOCK"]] * 2 if rdma else all(c is None for c in capabilities)


def test_prefill_and_decode_must_run_the_same_tensor_parallel_size() -> None:
    """KV moves rank to rank between a prefill and a decode worker (sender_pool refuses a
    layout mismatch), so pools of different sizes would fail every hand-off."""
    message = render_error({"decode": {"gpus": 2}})  # prefill keeps its 1
    assert "prefill runs 1 tensor-parallel ranks and decode 2" in message
    cpu = {"image": {"variant": "cpu"}, "prefill": {"gpus": 0}, "decode": {"gpus": 0}}
    render(cpu)  # both one rank
    render({**AGGREGATED, "aggregated": {"gpus": 4}})  # one pool: nothing to match


def test_a_gpu_pool_runs_on_cuda_or_fails_to_start() -> None:
    """device auto would fall back to the CPU, silently, in a pod whose GPUs the worker cannot
    see (no libcuda on the path, an old driver): a pool with GPUs gets cuda, which fails the
    start instead."""
    rendered = render({})
    for component in ("prefill", "decode"):
        assert env(worker_container(rendered, component))["SPLITSERVE_DEVICE"] == "cuda"
    cpu = render({"image": {"variant": "cpu"}, "prefill": {"gpus": 0}, "decode": {"gpus": 0}})
    assert env(worker_container(cpu, "decode"))["SPLITSERVE_DEVICE"] == "auto"
    pinned = render({"worker": {"device": "cpu"}})
    assert env(worker_container(pinned, "decode"))["SPLITSERVE_DEVICE"] == "cpu"


def test_rollouts_fit_a_cluster_without_a_spare_gpu_and_wait_for_a_model_load() -> None:
    rendered = render({})
    spec = rendered.get("Deployment", f"{FULLNAME}-decode")["spec"]
    assert spec["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    assert spec["progressDeadlineSeconds"] > 600 + 600  # a node, an image, a model load
    full = render({"worker": {"maxSurge": 0, "maxUnavailable": 1}})
    assert full.get("Deployment", f"{FULLNAME}-decode")["spec"]["strategy"]["rollingUpdate"] == {
        "maxUnavailable": 1, "maxSurge": 0}
    assert "both 0" in render_error({"worker": {"maxSurge": 0}})
    # As percentages too, which the API server refuses alike (a chart audit).
    assert "both 0" in render_error({"worker": {"maxSurge": "0%", "maxUnavailable": "0%"}})
    message = render_error({"worker": {"progressDeadlineSeconds": 600}})
    assert "must exceed startupTimeoutSeconds (600)" in message


def test_keda_scales_down_at_the_hpa_pace() -> None:
    """The HPA KEDA makes would otherwise remove every surplus pod at once."""
    rendered = render({"keda": {"enabled": True}, "autoscaler": {"enabled": False}})
    for obj in rendered.of_kind("ScaledObject"):
        behavior = obj["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert behavior["scaleDown"]["policies"] == [
            {"type": "Pods", "value": 1, "periodSeconds": 120}]
        # Nor may an empty answer read as 0 scale a pool down (a chart audit): no
        # ServiceMonitor here, so the default queries find nothing, and the notes say so.
        assert obj["spec"]["triggers"][0]["metadata"]["ignoreNullValues"] == "false"
    assert "KEDA holds the pools where they are" in rendered.notes
    monitored = render({"keda": {"enabled": True}, "autoscaler": {"enabled": False},
                        "metrics": {"serviceMonitor": {"enabled": True}}})
    assert "KEDA holds the pools" not in monitored.notes


def test_install_notes_warn_of_cpu_autoscaler_defaults_on_gpu_pools_and_single_replicas() -> None:
    notes = render({}).notes
    assert "from the bundled profile" in notes and "startupSeconds is -1" in notes
    assert "runs one replica" not in notes  # the autoscaler owns the pool sizes
    tuned = render({"autoscaler": {"startupSeconds": 240,
                                   "profile": {"existingConfigMap": "measured-on-h100"}}}).notes
    assert "bundled profile" not in tuned and "startupSeconds" not in tuned
    fixed = render({"autoscaler": {"enabled": False}}).notes
    assert "NOTE: prefill runs one replica" in fixed and "NOTE: decode runs one replica" in fixed
    assert "runs one replica" not in render({"autoscaler": {"enabled": False},
                                             "prefill": {"replicas": 2},
                                             "decode": {"replicas": 2}}).notes


def test_a_claim_nothing_can_fill_is_refused_and_a_moving_revision_warned_of() -> None:
    empty = {"model": {"volume": {"pvc": {"create": True}}}}  # ReadOnlyMany, no download
    assert "can never be filled" in render_error(empty)
    render({"model": {"volume": {"pvc": {"create": True, "accessModes": ["ReadWriteMany"]}},
                      "download": {"enabled": True}}})
    branch = render({"model": {"volume": {"type": "emptyDir"}, "download": {"enabled": True}}})
    assert 'revision is "main", a branch' in branch.notes
    pinned = render({"model": {"volume": {"type": "emptyDir"}, "download": {
        "enabled": True, "huggingface": {"revision": "a" * 40}}}})
    assert "a branch" not in pinned.notes
