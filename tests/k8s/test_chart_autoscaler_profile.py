"""The built-in autoscaler gets its hardware profile from a ConfigMap (inline in the values, or
one the operator manages) as --profile, and its worker start-up as --startup-s; contradictory or
malformed profile values fail rendering. (The autoscaler reading such a mounted file:
tests/autoscaler/test_profile_configmap.py.)"""

from __future__ import annotations

import json

import helm_python as helm
import pytest
from chart_render import RELEASE, render, render_scenario

from tests.autoscaler.sample_profiles import make_profile

NAME = f"{RELEASE}-splitserve-autoscaler"


def autoscaler(rendered) -> tuple[dict, list[str]]:
    pod = rendered.get("Deployment", NAME)["spec"]["template"]["spec"]
    return pod, pod["containers"][0]["args"]


def test_inline_profile_is_a_configmap_mounted_as_the_profile_flag() -> None:
    text = make_profile(device="cuda").to_json()
    rendered = render({"autoscaler": {"profile": {"inline": text}, "startupSeconds": 90}})
    configmap = rendered.get("ConfigMap", f"{NAME}-profile")
    assert json.loads(configmap["data"]["profile.json"]) == json.loads(text)
    pod, args = autoscaler(rendered)
    assert args[args.index("--profile") + 1] == "/etc/splitserve/profile/profile.json"
    assert args[args.index("--startup-s") + 1] == "90"
    volume = {v["name"]: v for v in pod["volumes"]}["profile"]
    assert volume["configMap"] == {"name": f"{NAME}-profile",
                                   "items": [{"key": "profile.json", "path": "profile.json"}]}
    mount = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}["profile"]
    assert mount == {"name": "profile", "mountPath": "/etc/splitserve/profile", "readOnly": True}


def test_an_edited_inline_profile_rolls_the_autoscaler() -> None:
    """The profile is read once at start: the pod template carries its digest, so a helm
    upgrade with another profile restarts the autoscaler with it (before, it planned on with
    the old one)."""
    def digest(profile) -> str:
        rendered = render({"autoscaler": {"profile": {"inline": profile.to_json()}}})
        template = rendered.get("Deployment", NAME)["spec"]["template"]
        return template["metadata"]["annotations"]["checksum/profile"]

    assert digest(make_profile(device="cuda")) != digest(make_profile(device="cuda",
                                                                      kv_blocks=4000))


def test_existing_configmap_is_mounted_and_nothing_is_created() -> None:
    rendered = render_scenario("gpu-disaggregated-tcp")
    pod, args = autoscaler(rendered)
    assert {v["name"]: v for v in pod["volumes"]}["profile"]["configMap"]["name"] == \
        "splitserve-gpu-profile"
    assert f"{NAME}-profile" not in rendered.names("ConfigMap")
    assert args[args.index("--startup-s") + 1] == "180"


def test_no_profile_keeps_the_bundled_one_and_the_measured_startup() -> None:
    pod, args = autoscaler(render_scenario("default"))
    assert "--profile" not in args and "--startup-s" not in args
    assert "profile" not in {v["name"] for v in pod["volumes"]}


@pytest.mark.parametrize("profile, message", [
    ({"inline": "{not json", "existingConfigMap": ""}, "must be the JSON `splitserve profile`"),
    ({"inline": '{"model": "x"}'}, "must be the JSON `splitserve profile`"),
    ({"inline": make_profile().to_json(), "existingConfigMap": "mine"}, "choose one"),
])
def test_bad_profile_values_fail_rendering(profile: dict, message: str) -> None:
    with pytest.raises(helm.HelmError, match=message):
        render({"autoscaler": {"profile": profile}})
