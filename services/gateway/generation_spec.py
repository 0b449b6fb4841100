"""GenerationSpec: one choice of one request, built by api/preprocess.py, capped and charged by
admission, streamed by api/text_stream.py. A leaf, so that admission need not import the api."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.v1 import common_pb2

from engine.sampling_params import SamplingParams
from services.common import convert


@dataclass(frozen=True)
class GenerationSpec:
    """One choice of one request, ready for the dispatcher."""

    request_id: str
    index: int  # the choice's `index` in the response
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams  # seed always set
    stop: tuple[str, ...] = ()
    echo_text: str | None = None  # completions' echo: the prompt text to prepend
    # Completions' echo with max_tokens 0: the prompt and its logprobs, no output (the one
    # token the worker generates for them is left out).
    score_only: bool = False
    include_stop_str: bool = False  # vLLM's include_stop_str_in_output: keep the matched stop
    skip_special_tokens: bool = True  # special tokens' text left out of the output
    # vLLM's: False writes adjacent added tokens' texts with nothing between (detokenizer.py).
    spaces_between_special_tokens: bool = True
    return_token_ids: bool = False  # vLLM's: token ids beside the text (RL and eval clients)
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: "token_id:N" in logprobs
    return_prompt_logprobs: bool = False  # vLLM's prompt_logprobs field in the response
    # Prefix-cache salt of the tenant (admission sets it): the workers and the router hash the
    # prompt's blocks from it, so tenants never share cached KV unless their group says so.
    cache_salt: str = ""
    client_cache_salt: str = ""  # vLLM's cache_salt from the body: narrows the tenant's salt

    @property
    def logprobs(self) -> int | None:
        return self.params.logprobs

    def sampling_pb(self) -> common_pb2.SamplingParams:
        return convert.sampling_to_pb(self.params)
