"""The protobuf edge of the workers: splitserve.v1 messages <-> engine types. Protobuf types
go no further inward than this module."""

from __future__ import annotations

from splitserve.v1 import common_pb2

from engine.outputs import ComputeSeconds, Logprobs
from engine.sampling_params import SamplingParams, StructuredOutput

FINISH_REASONS = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "error": common_pb2.FINISH_REASON_ERROR,
}
FINISH_REASON_NAMES = {v: k for k, v in FINISH_REASONS.items()}


def sampling_from_pb(pb: common_pb2.SamplingParams) -> SamplingParams:
    """Defaults for unset fields match the OpenAI API's."""
    return SamplingParams(
        max_tokens=pb.max_tokens or 16,
        temperature=pb.temperature if pb.has_temperature else 1.0,
        top_p=pb.top_p or 1.0,
        top_k=pb.top_k,
        min_p=pb.min_p,
        seed=pb.seed if pb.HasField("seed") else None,
        repetition_penalty=pb.repetition_penalty or 1.0,
        presence_penalty=pb.presence_penalty,
        frequency_penalty=pb.frequency_penalty,
        stop_token_ids=tuple(pb.stop_token_ids),
        ignore_eos=pb.ignore_eos,
        logprobs=pb.logprobs if pb.HasField("logprobs") else None,
        prompt_logprobs=pb.prompt_logprobs if pb.HasField("prompt_logprobs") else None,
        disable_speculation=pb.disable_speculation,
        structured_output=(structured_from_pb(pb.structured_output)
                           if pb.HasField("structured_output") else None),
        logit_bias=tuple((b.token_id, b.bias) for b in pb.logit_bias),
        allowed_token_ids=tuple(pb.allowed_token_ids),
        min_tokens=pb.min_tokens,
        bad_words_token_ids=tuple(tuple(s.token_ids) for s in pb.bad_words),
    )


def structured_from_pb(pb: common_pb2.StructuredOutput) -> StructuredOutput | None:
    """None for a message with no kind set (SamplingParams.validate then has nothing to check;
    an empty oneof is what an older gateway would never send)."""
    kind = pb.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "choice":
        return StructuredOutput(choice=tuple(pb.choice.values))
    return StructuredOutput(**{kind: getattr(pb, kind)})


def structured_to_pb(so: StructuredOutput) -> common_pb2.StructuredOutput:
    kind = so.kind
    if kind == "choice":
        return common_pb2.StructuredOutput(choice=common_pb2.Choices(values=list(so.choice)))
    return common_pb2.StructuredOutput(**{kind: getattr(so, kind)})


def sampling_to_pb(params: SamplingParams) -> common_pb2.SamplingParams:
    pb = common_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        has_temperature=True,
        top_p=params.top_p,
        top_k=max(params.top_k, 0),
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        disable_speculation=params.disable_speculation,
        logit_bias=[common_pb2.TokenBias(token_id=t, bias=b) for t, b in params.logit_bias],
        allowed_token_ids=list(params.allowed_token_ids),
        min_tokens=params.min_tokens,
        bad_words=[common_pb2.TokenSequence(token_ids=list(s)) for s in params.bad_words_token_ids],
    )
    if params.seed is not None:
        pb.seed = params.seed
    if params.logprobs is not None:
        pb.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        pb.prompt_logprobs = params.prompt_logprobs
    if params.structured_output is not None:
        pb.structured_output.CopyFrom(structured_to_pb(params.structured_output))
    return pb


def logprob_to_pb(token_id: int, lp: Logprobs | None) -> common_pb2.TokenLogprob:
    if lp is None:
        return common_pb2.TokenLogprob(token_id=token_id)
    return common_pb2.TokenLogprob(
        token_id=token_id,
        logprob=lp.logprob,
        rank=lp.rank,
        top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top.items()],
    )


def logprob_from_pb(pb: common_pb2.TokenLogprob) -> Logprobs:
    return Logprobs(logprob=pb.logprob, rank=pb.rank, top={t.token_id: t.logprob for t in pb.top})


def stats_to_pb(stats: dict[str, float]) -> common_pb2.WorkerStats:
    fields = common_pb2.WorkerStats.DESCRIPTOR.fields_by_name
    return common_pb2.WorkerStats(**{
        k: float(v) if fields[k].type == fields[k].TYPE_DOUBLE else int(v)
        for k, v in stats.items() if k in fields})


def compute_to_pb(compute: ComputeSeconds | None) -> common_pb2.ComputeSeconds:
    c = compute or ComputeSeconds()
    return common_pb2.ComputeSeconds(prefill=c.prefill, decode=c.decode, transfer=c.transfer)


def compute_from_pb(pb: common_pb2.ComputeSeconds) -> ComputeSeconds:
    """Negative or non-finite seconds (a bad peer) count as none, never as a credit."""
    return ComputeSeconds(*(v if 0.0 <= v < float("inf") else 0.0
                            for v in (pb.prefill, pb.decode, pb.transfer)))
