"""`make install` builds the C++ CPU kernels (`python -m kernels.cpu_kernels`), so no worker
start waits on the compiler; where there is no compiler the step says so and succeeds, and the
lazy build at first use stays the fallback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import cpu_kernels

REPO = Path(__file__).resolve().parents[2]


def _build_step(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kernels.cpu_kernels"], cwd=REPO,
                          env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), **env},
                          capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_install_runs_the_kernel_build_step():
    dry_run = subprocess.run(["make", "-n", "install"], cwd=REPO, capture_output=True,
                             text=True, timeout=60)
    assert "-m kernels.cpu_kernels" in dry_run.stdout, dry_run.stdout + dry_run.stderr


def test_the_build_step_without_a_compiler_succeeds_and_names_the_fallback(tmp_path):
    result = _build_step(tmp_path, CXX=str(tmp_path / "no-such-c++"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "C++ CPU kernels not built; workers use the torch reference" in result.stdout
    assert "no-such-c++" in result.stdout  # the compiler's complaint, not only a verdict


@pytest.mark.skipif(not cpu_kernels.load(), reason="needs a built library to copy")
def test_the_build_step_reports_the_library_a_worker_will_load(tmp_path):
    """With the library already built for these sources (what the install step leaves), the
    step only loads it, with no compiler: a worker start then pays no build either."""
    library = cpu_kernels.library_path()
    folder = tmp_path / "ext" / library.parent.name
    folder.mkdir(parents=True)
    shutil.copy(library, folder / library.name)
    result = _build_step(tmp_path, CXX=str(tmp_path / "no-such-c++"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith(f"C++ CPU kernels: {folder / library.name} ("), result.stdout
