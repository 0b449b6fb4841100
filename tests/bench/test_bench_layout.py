"""bench/ scripts run as `python bench/NAME.py`, which puts bench/ first on sys.path: a module
there named like a top-level package (bench/kv_transfer.py was) is what `import kv_transfer`
then finds, and every script that imports the engine failed at start-up."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _packages() -> set[str]:
    return {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()} | {
        p.stem for p in ROOT.glob("*.py")}


def test_no_bench_module_shadows_a_top_level_package():
    bench = {p.stem for p in (ROOT / "bench").glob("*.py")} | {
        p.name for p in (ROOT / "bench").iterdir() if (p / "__init__.py").exists()}
    assert "engine" in _packages() and "kv_transfer" in _packages()
    assert not bench & _packages(), f"bench/ shadows {sorted(bench & _packages())}"


def test_a_bench_script_that_imports_the_engine_starts():
    """`python bench/prefill.py --help` imports the engine (and through it kv_transfer) as the
    README's commands run it."""
    result = subprocess.run([sys.executable, "bench/prefill.py", "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage" in result.stdout
