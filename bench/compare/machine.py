"""What a benchmark ran on (cores, CPU model, library versions, commit), and how much of the
machine's CPU other work took while it ran."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path


def machine() -> dict:
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    versions = {}
    for module in ("torch", "transformers"):
        try:
            versions[module] = __import__(module).__version__
        except ImportError:
            versions[module] = "absent"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=False).stdout.strip()
    except OSError:
        commit = ""
    return {"cores": cores(), "cpu": cpu, "python": platform.python_version(), "commit": commit,
            "uncommitted": uncommitted(), **versions}


# The code a benchmark runs: an uncommitted change here means the commit alone does not say what
# was measured (a shared working tree can change under a sweep).
MEASURED_CODE = ("engine", "services", "kernels", "kv_transfer", "splitserve_cli", "protos")


def uncommitted() -> list[str]:
    """Paths under MEASURED_CODE that differ from HEAD (staged, unstaged or untracked)."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--", *MEASURED_CODE],
                             capture_output=True, text=True, check=False).stdout
    except OSError:
        return []
    return [line[3:] for line in out.splitlines() if line.strip()]


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


_TICK = os.sysconf("SC_CLK_TCK")


def _busy_seconds() -> float:
    """CPU seconds every core spent busy since boot, steal time (taken by the hypervisor for
    other guests) included. /proc/stat's first line: user nice system idle iowait irq softirq
    steal ..."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / _TICK


def _process_seconds(pid: int) -> float:
    """utime + stime of one process (all its threads), 0 if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def process_tree(root: int) -> list[int]:
    """root and every live descendant (by parent pid; sessions do not matter)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


def wait_quiet(max_s: float = 20.0, busy_share: float = 0.1, window_s: float = 0.5) -> float:
    """Waits until the whole machine's busy share over a window (steal included) is at most
    `busy_share` of its cores, or `max_s` has passed; returns the seconds waited. Between two
    systems' turns: what the one before left running (splitserve's idle-time KV prefault
    after a burst, a peer's own background work) ends before the next one is measured."""
    start = time.monotonic()
    while True:
        t0, busy0 = time.monotonic(), _busy_seconds()
        time.sleep(window_s)
        t1, busy1 = time.monotonic(), _busy_seconds()
        if (busy1 - busy0) / max((t1 - t0) * cores(), 1e-9) <= busy_share or t1 - start >= max_s:
            return t1 - start


class ForeignCpu:
    """Share of the machine's CPU time, over a measured interval, that went to anything but the
    benchmark's own processes (the system under test's process tree and this load generator):
    other tenants' jobs and hypervisor steal. 0 means the benchmark had the machine to itself.
    Read at start and stop by the sweep's main thread."""

    def __init__(self, system_root_pid: int) -> None:
        self.pids = [os.getpid(), *process_tree(system_root_pid)]
        self._start = self._read()

    def _read(self) -> tuple[float, float, float]:
        return time.monotonic(), _busy_seconds(), sum(_process_seconds(p) for p in self.pids)

    def stop(self) -> dict:
        (t0, busy0, ours0), (t1, busy1, ours1) = self._start, self._read()
        capacity = max((t1 - t0) * cores(), 1e-9)
        return {"foreign_cpu_share": round(max(0.0, (busy1 - busy0) - (ours1 - ours0)) / capacity, 3),
                "own_cpu_share": round((ours1 - ours0) / capacity, 3),
                "loadavg_1m_end": round(os.getloadavg()[0], 2)}
