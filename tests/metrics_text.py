"""Reading a process's Prometheus `/metrics` in tests."""

from __future__ import annotations

import re

import httpx

# Worker series carry the served model's name before their role; tests that key on the role
# alone still find them.
_WORKER_MODEL_LABEL = re.compile(r'(?<=\{)model="[^"]*",(?=role=)')


def scrape(url: str) -> dict[str, float]:
    """Every sample on `{url}/metrics`, keyed by its name and labels as the text format writes
    them (e.g. `splitserve_kv_blocks_used{model="m",role="decode"}`); a worker series also once
    more without its `model` label (`splitserve_kv_blocks_used{role="decode"}`)."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
            without = _WORKER_MODEL_LABEL.sub("", name, count=1)
            if without != name:
                values.setdefault(without, float(value))
    return values


def scrape_worker(worker) -> dict[str, float]:
    """`scrape` of a worker started by splitserve_cli.processes.start_worker."""
    return scrape(f"http://{worker.metrics_address}")
