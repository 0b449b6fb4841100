"""transformers' side, the second peer: `generate` on static batches in arrival order (prompts
padded left; a batch runs until its longest request is done, only each request's own tokens
count). Greedy only: one GenerationConfig per batch cannot carry per-request penalties."""

from __future__ import annotations

import time

import torch

from bench.offline.workload import Workload


class HFGenerateRunner:
    def __init__(self, model, batch_size: int) -> None:
        self.model, self.batch_size = model, batch_size
        pad = model.config.pad_token_id
        self.pad_id = pad if pad is not None else 0

    def run(self, work: Workload) -> dict:
        from transformers import GenerationConfig

        if any(r.temperature for r in work.requests):
            raise ValueError("the transformers runner is greedy only")
        wall, cpu = time.perf_counter(), time.process_time()
        done = 0
        for first in range(0, len(work.requests), self.batch_size):
            batch = work.requests[first : first + self.batch_size]
            new = max(r.max_tokens for r in batch)
            width = max(len(r.prompt) for r in batch)
            ids = torch.tensor([[self.pad_id] * (width - len(r.prompt)) + r.prompt for r in batch])
            mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch])
            config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                      pad_token_id=self.pad_id, eos_token_id=None)
            with torch.inference_mode():
                out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
            if out.shape[1] != width + new:
                raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens, expected {new}")
            done += sum(r.max_tokens for r in batch)
        # No prefix cache: cached_tokens is 0 by construction.
        return {"seconds": time.perf_counter() - wall, "cpu_seconds": time.process_time() - cpu,
                "output_tokens": done, "cached_tokens": 0}
