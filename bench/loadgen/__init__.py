"""An async load generator for OpenAI-compatible streaming endpoints.

`python -m bench.loadgen --help` for the CLI; `run_load` for use from Python (bench.compare).
"""

from bench.loadgen.arrivals import Burst, ClosedLoop, Gamma, Poisson, Spike
from bench.loadgen.client import Target
from bench.loadgen.metrics import SLO, RequestRecord, Summary, summarize
from bench.loadgen.runner import LoadResult, RunConfig, run_load
from bench.loadgen.workload import Workload, preset

__all__ = [
    "SLO", "Burst", "ClosedLoop", "Gamma", "LoadResult", "Poisson", "RequestRecord", "RunConfig",
    "Spike", "Summary", "Target", "Workload", "preset", "run_load", "summarize",
]
