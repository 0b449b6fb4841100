"""Where worker pods run when nodes fail: they leave a node that stopped answering after
30 s, not Kubernetes' default 300 s, during which a pool ran one short while the dead pod
still counted as capacity."""

from __future__ import annotations

from chart_render import render, worker_deployments


def test_worker_pods_leave_a_dead_node_after_30_seconds() -> None:
    rendered = render({})
    for name in worker_deployments(rendered):
        tolerations = rendered.get("Deployment", name)["spec"]["template"]["spec"]["tolerations"]
        for taint in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"):
            assert {"key": taint, "operator": "Exists", "effect": "NoExecute",
                    "tolerationSeconds": 30} in tolerations, (name, taint)

