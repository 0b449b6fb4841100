"""Cost per query: each engine step's wall time split over the requests it ran.

A row is charged by its share of the step's scheduled tokens: a prefill chunk by its length,
a decode row one token's worth (equal shares among decode rows), a speculative row by the
tokens it verified. Owned by the engine thread, like the requests it charges.
"""

from __future__ import annotations

from engine.outputs import SchedulerOutput
from engine.request import Request

# (request, tokens scheduled for it, whether those tokens are prompt work)
StepRow = tuple[Request, int, bool]


def step_rows(requests: dict[str, Request], sched: SchedulerOutput) -> tuple[list[StepRow], int]:
    """The rows of a scheduled step and their token total, read before the step runs (the
    update moves num_computed_tokens). Prompt work: more than one token without KV, or a
    request with no output yet; a resumed request's recompute is prompt work too."""
    rows: list[StepRow] = []
    total = 0
    for rid, num_tokens in sched.num_scheduled_tokens.items():
        request = requests.get(rid)
        if request is None:
            continue
        prefill = (request.num_tokens - request.num_computed_tokens > 1
                   or len(request.all_token_ids) == len(request.prompt_token_ids))
        rows.append((request, num_tokens, prefill))
        total += num_tokens
    return rows, total


def charge_step(rows: list[StepRow], total_tokens: int, seconds: float) -> None:
    """Add each row's share of `seconds` to its request: one multiply and add per row."""
    if total_tokens <= 0 or seconds <= 0:
        return
    per_token = seconds / total_tokens
    for request, num_tokens, prefill in rows:
        if prefill:
            request.prefill_seconds += num_tokens * per_token
        else:
            request.decode_seconds += num_tokens * per_token
