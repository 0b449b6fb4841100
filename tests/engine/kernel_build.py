"""The C++ CPU kernels for the kernel test modules: where they did not build those modules skip,
except in CI (CI=true), where a build failure fails collection with the compiler's message
instead of hiding every kernel test behind a skip."""

from __future__ import annotations

import os

import pytest

from kernels import cpu_kernels


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def require_cpu_kernels(also: bool = True, reason: str = "") -> pytest.MarkDecorator:
    """A module's pytestmark: skip unless the kernels built (and `also` holds, e.g. the CPU has
    avx512_bf16, which is the machine's and never a CI failure). Call at module level."""
    if not cpu_kernels.load():
        if in_ci():
            pytest.fail(f"CI=true and the C++ CPU kernels did not build: {cpu_kernels.build_error()}",
                        pytrace=False)
        return pytest.mark.skip(reason=f"the C++ CPU kernels did not build: {cpu_kernels.build_error()}")
    return pytest.mark.skipif(not also, reason=reason)
