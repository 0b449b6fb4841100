"""What a benchmark ran with, against what ships: the gateway's admission settings in effect and
every setting a benchmark changed from its shipped default, each with the reason, so that a
printed figure says which system it measured ("the system we measure is the system we ship")."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields

from services.gateway.config import GatewayConfig, _env_name  # no torch: the gateway loads none

# The gateway fields that decide which requests are admitted, released or refused.
ADMISSION_FIELDS = ("ttft_target_s", "tpot_target_s", "max_inflight", "max_inflight_per_decode",
                    "max_inflight_per_key", "kv_headroom", "max_prefill_queue_tokens", "fairness")
# What a zero means in the fields where zero is not a number but a rule.
_ZERO_MEANS = {"ttft_target_s": "off", "tpot_target_s": "off", "max_inflight": "no limit",
               "max_inflight_per_decode": "the decode workers' max_running",
               "max_inflight_per_key": "no limit", "max_prefill_queue_tokens": "no limit"}


def gateway_default(name: str):
    """The shipped default of a GatewayConfig field (the flag's default with no env set)."""
    return {f.name: f.default for f in fields(GatewayConfig)}[name]


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def _text(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _shown(name: str, text: str) -> str:
    """A gateway value with what it means where zero is a rule: "0 (off)"."""
    meaning = _ZERO_MEANS.get(name) if text in ("0", "0.0") else None
    return f"{text} ({meaning})" if meaning else text


@dataclass(frozen=True)
class Override:
    """One setting a benchmark changed from what ships. `process` is who gets it: "gateway"
    (a GatewayConfig field, passed as its flag), "workers", "peer" or "bench"."""

    process: str
    setting: str  # a GatewayConfig field name for the gateway, else the flag or env name
    value: str
    default: str
    reason: str

    def line(self) -> str:
        if self.process == "gateway":
            setting = flag_of(self.setting)
            value, default = _shown(self.setting, self.value), _shown(self.setting, self.default)
        else:
            setting, value, default = self.setting, self.value, self.default
        return f"{self.process} {setting} {value} (shipped: {default}): {self.reason}"


def gateway_override(name: str, value, reason: str) -> Override:
    return Override("gateway", name, _text(value), _text(gateway_default(name)), reason)


def inherited_admission(env: dict[str, str] | None = None) -> tuple[Override, ...]:
    """Admission settings the gateway would take from this shell's environment (SPLITSERVE_
    GATEWAY_*): a benchmark's child inherits them, so they are overrides too."""
    env = os.environ if env is None else env
    return tuple(Override("gateway", name, env[_env_name(name)],
                          _text(gateway_default(name)), f"{_env_name(name)} is set in the environment")
                 for name in ADMISSION_FIELDS if env.get(_env_name(name), "") != "")


def with_inherited(overrides: tuple[Override, ...]) -> tuple[Override, ...]:
    """`overrides` plus the inherited admission settings they do not set themselves."""
    own = {o.setting for o in overrides if o.process == "gateway"}
    return overrides + tuple(o for o in inherited_admission() if o.setting not in own)


@dataclass(frozen=True)
class RunSettings:
    """A benchmark's settings: `gateway` False for one that talks to the workers directly (no
    admission in the path); `overrides` lists every change from the shipped defaults."""

    bench: str
    overrides: tuple[Override, ...] = ()
    gateway: bool = True
    note: str = ""  # anything else a reader of the figures must know

    def gateway_args(self) -> list[str]:
        """The flags the benchmark passes to its gateway: its gateway overrides, nothing else."""
        args: list[str] = []
        for o in self.overrides:
            if o.process == "gateway":
                args += [flag_of(o.setting), o.value]
        return args

    def gateway_env(self) -> dict[str, str]:
        """The same as environment variables, for a gateway started by `splitserve up`."""
        return {_env_name(o.setting): o.value for o in self.overrides if o.process == "gateway"}

    def admission(self) -> dict[str, str]:
        """The admission settings in effect at the gateway, overrides applied."""
        if not self.gateway:
            return {}
        values = {name: _text(gateway_default(name)) for name in ADMISSION_FIELDS}
        values.update({o.setting: o.value for o in self.overrides
                       if o.process == "gateway" and o.setting in values})
        return {name: _shown(name, text) for name, text in values.items()}

    def lines(self) -> list[str]:
        return describe(self.to_json())

    def text(self) -> str:
        return "\n".join(self.lines())

    def to_json(self) -> dict:
        return {"bench": self.bench, "gateway": self.gateway, "admission": self.admission(),
                "overrides": [asdict(o) for o in self.overrides], "note": self.note}


def describe(recorded: dict) -> list[str]:
    """The printed configuration, from RunSettings.to_json() (a report re-rendered later shows
    what was recorded, not today's defaults)."""
    overrides = [Override(**o) for o in recorded["overrides"]]
    if recorded["gateway"]:
        changed = {o.setting for o in overrides if o.process == "gateway"}
        admission = ", ".join(f"{k}={v}" + ("" if k in changed else " [default]")
                              for k, v in recorded["admission"].items())
        head = f"{recorded['bench']}: gateway admission: {admission}"
    else:
        head = (f"{recorded['bench']}: no gateway in the path (requests go to the workers' gRPC "
                "directly), so no admission control applies")
    body = [f"  override: {o.line()}" for o in overrides] or [
        "  overrides: none (every setting is the shipped default)"]
    return [head, *body] + ([f"  note: {recorded['note']}"] if recorded.get("note") else [])


def markdown(recorded: dict) -> list[str]:
    """describe() as a markdown list, for a report.md."""
    return [f"- {line.strip()}" for line in describe(recorded)]
