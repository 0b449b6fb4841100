"""How bench.compare sets up the systems (dtype, threads) and measures other work on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from bench.compare.machine import ForeignCpu, cores, process_tree
from bench.compare.systems import SYSTEMS, ServeOptions


def test_peer_runs_the_same_dtype_unless_told_otherwise():
    peer = SYSTEMS["transformers-serve"]
    command = peer.command("m", 1234, ServeOptions(dtype="bfloat16"))
    assert command[command.index("--dtype") + 1] == "bfloat16"
    command = peer.command("m", 1234, ServeOptions(dtype="bfloat16", peer_dtype="float32"))
    assert command[command.index("--dtype") + 1] == "float32"


def test_peer_gets_as_many_threads_as_splitserve_workers_together():
    assert ServeOptions().peer_omp_threads() == cores()
    assert ServeOptions(peer_threads=1).peer_omp_threads() == 1


def test_process_tree_follows_children_across_sessions():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                             start_new_session=True)
    try:
        assert child.pid in process_tree(os.getpid())
    finally:
        child.kill()
        child.wait()


def test_cpu_this_process_burns_counts_as_its_own_not_foreign():
    meter = ForeignCpu(os.getpid())
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    share = meter.stop()
    assert share["own_cpu_share"] > 0.0
    assert 0.0 <= share["foreign_cpu_share"] <= 1.0
