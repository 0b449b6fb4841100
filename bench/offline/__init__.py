"""The offline engine benchmark's parts (bench/engine_throughput.py drives them): the workload,
the read-bandwidth floor, one runner per system (splitserve, vLLM in its own venv, transformers),
the timed-phase loop they share, and the report."""
