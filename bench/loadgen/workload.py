"""Workloads: what each request asks for (prompt and output lengths in tokens, a shared-prefix
group, a tenant), drawn from a seeded generator so that a run can be repeated exactly."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True)
class Fixed:
    length: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.full(n, self.length, dtype=np.int64)

    def describe(self) -> str:
        return str(self.length)


@dataclass(frozen=True)
class Uniform:
    """Integers in [low, high], both ends included."""

    low: int
    high: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(self.low, self.high, n, endpoint=True)

    def describe(self) -> str:
        return f"uniform[{self.low},{self.high}]"


@dataclass(frozen=True)
class LongTailed:
    """Log-normal around `median`, kept within [low, high] by redrawing what falls outside (not by
    clamping, which would pile mass on the bounds): most requests short, a few long, as in chat
    traffic."""

    low: int
    high: int
    median: float
    sigma: float = 0.7

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        out = np.empty(0, dtype=np.int64)
        while out.size < n:
            draw = np.rint(rng.lognormal(np.log(self.median), self.sigma, 2 * n + 8))
            keep = draw[(draw >= self.low) & (draw <= self.high)].astype(np.int64)
            out = np.concatenate([out, keep])
        return out[:n]

    def describe(self) -> str:
        return f"lognormal(median={self.median:g},sigma={self.sigma:g})[{self.low},{self.high}]"


LengthDistribution = Fixed | Uniform | LongTailed


@dataclass(frozen=True)
class RequestClass:
    """One kind of request in a mix, e.g. 'steady' decode streams or 'long' prompts."""

    name: str
    weight: float
    prompt_len: LengthDistribution
    output_len: LengthDistribution
    # Request-body fields of this class's sampling (e.g. temperature, top_p, penalties,
    # logprobs), over the target's defaults; empty: the target's (greedy unless told).
    sampling: tuple[tuple[str, float | int], ...] = ()


@dataclass(frozen=True)
class Tenant:
    name: str
    api_key: str
    weight: float = 1.0


@dataclass(frozen=True)
class RequestSpec:
    """What one request asks for. prompt_len counts every prompt token, shared prefix included."""

    index: int
    cls: str
    prompt_len: int
    output_len: int
    prefix_group: int = -1  # -1: no shared prefix
    tenant: str = ""
    api_key: str = ""
    sampling: tuple[tuple[str, float | int], ...] = ()  # its class's


@dataclass(frozen=True)
class Workload:
    """A request mix. With prefix_groups > 0, each request starts with one of that many shared
    prefixes of prefix_len tokens, added in front of its sampled prompt length."""

    name: str
    classes: tuple[RequestClass, ...]
    prefix_groups: int = 0
    prefix_len: int = 0
    tenants: tuple[Tenant, ...] = ()

    def __post_init__(self) -> None:
        if not self.classes:
            raise ValueError("a workload needs at least one request class")
        if self.prefix_groups < 0 or self.prefix_len < 0:
            raise ValueError("prefix_groups and prefix_len must be >= 0")
        if bool(self.prefix_groups) != bool(self.prefix_len):
            raise ValueError("give both prefix_groups and prefix_len, or neither")

    def specs(self, rng: np.random.Generator, block: int = 256) -> Iterator[RequestSpec]:
        """An endless, reproducible stream of requests. Drawn in fixed-size blocks, so the first
        n requests do not depend on how many are taken in the end."""
        weights = np.array([c.weight for c in self.classes], dtype=float)
        tenant_weights = np.array([t.weight for t in self.tenants], dtype=float)
        index = 0
        while True:
            which = rng.choice(len(self.classes), block, p=weights / weights.sum())
            prompts = np.zeros(block, dtype=np.int64)
            outputs = np.zeros(block, dtype=np.int64)
            for k, cls in enumerate(self.classes):
                mask = which == k
                prompts[mask] = cls.prompt_len.sample(rng, int(mask.sum()))
                outputs[mask] = cls.output_len.sample(rng, int(mask.sum()))
            groups = (rng.integers(0, self.prefix_groups, block) if self.prefix_groups
                      else np.full(block, -1))
            tenants = (rng.choice(len(self.tenants), block, p=tenant_weights / tenant_weights.sum())
                       if self.tenants else np.full(block, -1))
            for i in range(block):
                tenant = self.tenants[tenants[i]] if tenants[i] >= 0 else None
                yield RequestSpec(
                    index=index, cls=self.classes[which[i]].name,
                    prompt_len=int(prompts[i]) + (self.prefix_len if groups[i] >= 0 else 0),
                    output_len=int(outputs[i]), prefix_group=int(groups[i]),
                    tenant=tenant.name if tenant else "", api_key=tenant.api_key if tenant else "",
                    sampling=self.classes[which[i]].sampling)
                index += 1

    def sample(self, rng: np.random.Generator, n: int) -> list[RequestSpec]:
        stream = self.specs(rng)
        return [next(stream) for _ in range(n)]

    def describe(self) -> str:
        parts = [f"{c.name}(w={c.weight:g}, in={c.prompt_len.describe()}, "
                 f"out={c.output_len.describe()}"
                 + "".join(f", {k}={v:g}" for k, v in c.sampling) + ")" for c in self.classes]
        extra = f", {self.prefix_groups} prefixes of {self.prefix_len}" if self.prefix_groups else ""
        tenants = f", tenants={','.join(t.name for t in self.tenants)}" if self.tenants else ""
        return f"{self.name}: " + " + ".join(parts) + extra + tenants


def preset(name: str, *, input_len: int = 128, output_len: int = 128,
           input_range: tuple[int, int] = (64, 512), output_range: tuple[int, int] = (32, 256),
           long_prompt_len: int = 1536) -> Workload:
    """The named workloads.

    fixed        every request input_len in, output_len out
    uniform      lengths uniform over input_range / output_range
    chat         long-tailed lengths within input_range / output_range (medians a quarter of
                 the way into each range), like chat traffic
    chat-sampled the chat lengths, sampled as users sample: 40% greedy, 40% temperature 0.8
                 top_p 0.95, 20% the same with presence and frequency penalties and the top-2
                 logprobs of every token
    interference 80% 'steady' requests (64 in, 192 out) and 20% 'long' prompts
                 (long_prompt_len in, 4 out): how much long prefills disturb running decodes
    """
    if name == "fixed":
        classes = (RequestClass("fixed", 1.0, Fixed(input_len), Fixed(output_len)),)
    elif name == "uniform":
        classes = (RequestClass("uniform", 1.0, Uniform(*input_range), Uniform(*output_range)),)
    elif name == "chat":
        (ilo, ihi), (olo, ohi) = input_range, output_range
        classes = (RequestClass("chat", 1.0,
                                LongTailed(ilo, ihi, median=ilo + (ihi - ilo) / 4),
                                LongTailed(olo, ohi, median=olo + (ohi - olo) / 4)),)
    elif name == "chat-sampled":
        (ilo, ihi), (olo, ohi) = input_range, output_range
        lengths = (LongTailed(ilo, ihi, median=ilo + (ihi - ilo) / 4),
                   LongTailed(olo, ohi, median=olo + (ohi - olo) / 4))
        nucleus = (("temperature", 0.8), ("top_p", 0.95))
        classes = (RequestClass("greedy", 0.4, *lengths, sampling=(("temperature", 0.0),)),
                   RequestClass("sampled", 0.4, *lengths, sampling=nucleus),
                   RequestClass("penalized", 0.2, *lengths, sampling=nucleus + (
                       ("presence_penalty", 0.5), ("frequency_penalty", 0.3), ("logprobs", 2))))
    elif name == "interference":
        classes = (RequestClass("steady", 0.8, Fixed(64), Fixed(192)),
                   RequestClass("long", 0.2, Fixed(long_prompt_len), Fixed(4)))
    else:
        raise ValueError(f"unknown workload {name!r}; one of {', '.join(PRESETS)}")
    return Workload(name, classes)


PRESETS = ("fixed", "uniform", "chat", "chat-sampled", "interference")


def with_prefixes(workload: Workload, groups: int, length: int) -> Workload:
    return replace(workload, prefix_groups=groups, prefix_len=length)


def with_tenants(workload: Workload, tenants: tuple[Tenant, ...]) -> Workload:
    return replace(workload, tenants=tenants)
