"""Constrained decoding in the engine: every sampled token is under the request's grammar (the
tiny random model, unconstrained, writes noise), and the grammar state is rebuilt wherever the
request goes: prefill worker to decode worker, preemption and recompute, a migration's resumed
outputs, speculative verification. Real llguidance, the tiny model's real tokenizer."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_harness import assert_no_leak, drive, make_engine, random_prompts
from spec_decode_harness import ScriptedProposer, drive_checked, spec_engine
from tokenizers import Tokenizer

from engine.sampling_params import SamplingParams, StructuredOutput
from engine.structured.masks import bias_from_bitmask

REGEX = "[0-9]{3}-[a-z]{2,4}"
CHOICES = ("alpha", "beta", "gamma delta")
SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["n", "color", "tags"],
    "additionalProperties": False,
}
JSON = StructuredOutput(json_schema=json.dumps(SCHEMA))


def sampled(so: StructuredOutput, seed: int, max_tokens: int = 60, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed,
                          structured_output=so, **kw)


@pytest.fixture(scope="module")
def decode(tiny_llama_dir):
    tokenizer = Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def assert_follows_schema(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"n", "color", "tags"}, text
    assert isinstance(value["n"], int) and 0 <= value["n"] <= 99, text
    assert value["color"] in ("red", "blue"), text
    assert len(value["tags"]) <= 3 and all(isinstance(t, str) and len(t) <= 6
                                           for t in value["tags"]), text


def test_regex_choice_and_schema_hold_on_every_sampled_generation(tiny_llama_dir, decode):
    engine = make_engine(tiny_llama_dir)
    constraints = [StructuredOutput(regex=REGEX), StructuredOutput(choice=CHOICES), JSON]
    prompts = random_prompts([7] * 60, seed=1)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, sampled(constraints[i % 3], seed=i))
    results = drive(engine)
    texts = {kind: set() for kind in ("regex", "choice", "json")}
    for i in range(len(prompts)):
        out = results[f"r{i}"]
        assert out.finish_reason == "stop", (i, decode(out.token_ids))
        assert out.token_ids[-1] in engine.model_config.eos_token_ids
        text = decode(out.token_ids)
        if i % 3 == 0:
            assert re.fullmatch(REGEX, text), text
            texts["regex"].add(text)
        elif i % 3 == 1:
            assert text in CHOICES
            texts["choice"].add(text)
        else:
            assert_follows_schema(text)
            texts["json"].add(text)
    # Sampling still samples: the constraint narrows the choice, it does not fix the text.
    assert all(len(seen) > 1 for seen in texts.values()), texts
    assert_no_leak(engine)


def test_greedy_decoding_is_constrained_too(tiny_llama_dir, decode):
    engine = make_engine(tiny_llama_dir)
    engine.add_request("r", random_prompts([9], seed=2)[0],
                       SamplingParams(max_tokens=60, temperature=0.0, structured_output=JSON))
    out = drive(engine)["r"]
    assert out.finish_reason == "stop"
    assert_follows_schema(decode(out.token_ids))


def test_the_mask_thread_starts_no_second_openmp_team(tiny_llama_dir, decode):
    """The grammar's mask thread runs torch work beside the engine's steps. With torch's
    process-wide count at two, it took two threads at its first parallel op and started a
    second OpenMP team: a 2-core worker then had more OpenMP threads than cores, GNU OpenMP
    stopped spinning at barriers, and every later batch-1 step took 24 ms instead of 13."""
    before = torch.get_num_threads()
    try:
        engine = make_engine(tiny_llama_dir, num_threads=2)
        engine.add_request("r", random_prompts([9], seed=2)[0],
                           SamplingParams(max_tokens=20, temperature=0.0, structured_output=JSON))
        drive(engine)
        masks = engine.runner.grammar_masks
        assert masks is not None and torch.get_num_threads() == 2
        assert masks._thread.submit(torch.get_num_threads).result(30) == 1
    finally:
        torch.set_num_threads(before)


def test_the_grammar_continues_from_a_prefill_engine_to_a_decode_engine(tiny_llama_dir, decode):
    prompts = dict(zip("abc", random_prompts([5, 13, 22], seed=3), strict=True))
    reference_engine = make_engine(tiny_llama_dir)
    for rid, prompt in prompts.items():
        reference_engine.add_request(rid, prompt, sampled(JSON, seed=7))
    reference = {rid: c.token_ids for rid, c in drive(reference_engine).items()}

    prefill_engine = make_engine(tiny_llama_dir, long_prefill_token_threshold=6)
    decode_engine = make_engine(tiny_llama_dir)
    results = {}
    for rid, prompt in prompts.items():
        decode_engine.remote.reserve(rid, prompt, sampled(JSON, seed=7))
        prefill_engine.add_request(rid, prompt, sampled(JSON, seed=7), hold_kv=True)
        (out,) = [o for _ in range(20) if prefill_engine.has_unfinished()
                  for o in prefill_engine.step()]
        # The prefill worker's one token is already under the grammar: an object opens.
        assert decode([out.new_token_ids[0]]).startswith("{")
        decode_engine.remote.receive(rid, out.new_token_ids[0], out.kv)
        results[rid] = [out.new_token_ids[0]]
    for rid, collected in drive(decode_engine).items():
        results[rid] += collected.token_ids
    assert results == reference
    for tokens in results.values():
        assert_follows_schema(decode(tokens))
    assert_no_leak(prefill_engine)
    assert_no_leak(decode_engine)


def test_the_grammar_survives_preemption_and_recompute(tiny_llama_dir, decode):
    prompt = random_prompts([11], seed=4)[0]
    params = sampled(JSON, seed=5, max_tokens=40)
    alone = make_engine(tiny_llama_dir)
    alone.add_request("r", prompt, params)
    reference = drive(alone)["r"].token_ids

    engine = make_engine(tiny_llama_dir, num_kv_blocks=12)
    engine.add_request("first", random_prompts([9], seed=6)[0],
                       SamplingParams(max_tokens=30, ignore_eos=True, seed=1))
    request = engine.add_request("r", prompt, params)
    results = drive(engine)
    assert request.num_preemptions > 0
    assert results["r"].token_ids == reference
    assert_follows_schema(decode(reference))
    assert_no_leak(engine)


def test_resumed_outputs_restore_the_grammar_for_a_migrated_request(tiny_llama_dir, decode):
    prompt = random_prompts([8], seed=8)[0]
    params = sampled(JSON, seed=9)
    whole = make_engine(tiny_llama_dir)
    whole.add_request("r", prompt, params)
    reference = drive(whole)["r"].token_ids
    done = len(reference) // 2
    assert_follows_schema(decode(reference))
    engine = make_engine(tiny_llama_dir)
    engine.add_request("r", prompt, params, resumed_output_token_ids=reference[:done])
    assert reference[:done] + drive(engine)["r"].token_ids == reference
    assert_no_leak(engine)


def test_resumed_outputs_outside_the_grammar_end_the_request_instead_of_failing_the_engine(
        tiny_llama_dir, decode):
    engine = make_engine(tiny_llama_dir)
    prompt = random_prompts([8], seed=10)[0]
    not_json = [t for t in random_prompts([6], seed=11)[0] if not decode([t]).startswith("{")]
    engine.add_request("bad", prompt, sampled(JSON, seed=1), resumed_output_token_ids=not_json)
    engine.add_request("good", prompt, sampled(JSON, seed=1))
    results = drive(engine)
    assert results["bad"].token_ids == [engine.model_config.eos_token_ids[0]]
    assert_follows_schema(decode(results["good"].token_ids))
    assert_no_leak(engine)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_speculative_proposals_outside_the_grammar_never_reach_the_output(tiny_llama_dir, decode,
                                                                          temperature):
    """The proposer offers the model's unconstrained continuation, which the target accepts
    whole when verification ignores the grammar. Under the grammar the output is exactly the
    non-speculative constrained one, both when the speculator cuts proposals at the grammar
    before scheduling them and when it does not (verification masks them then), and cutting
    schedules fewer proposals."""
    prompts = dict(zip("ab", random_prompts([6, 10], seed=12), strict=True))
    free = SamplingParams(max_tokens=60, temperature=temperature, seed=3, ignore_eos=True)
    params = SamplingParams(max_tokens=60, temperature=temperature, seed=3, structured_output=JSON)
    unconstrained, constrained = make_engine(tiny_llama_dir), make_engine(tiny_llama_dir)
    for rid, prompt in prompts.items():
        unconstrained.add_request(rid, prompt, free)
        constrained.add_request(rid, prompt, params)
    proposals = {rid: c.token_ids for rid, c in drive(unconstrained).items()}
    reference = {rid: c.token_ids for rid, c in drive(constrained).items()}

    proposed = {}
    for cut in (True, False):
        engine = spec_engine(tiny_llama_dir, k=4)
        engine.speculator.proposer = ScriptedProposer(proposals, lambda rid, i: False,
                                                      vocab=engine.model_config.vocab_size)
        if not cut:
            engine.speculator.grammar_prefix = None
        for rid, prompt in prompts.items():
            engine.add_request(rid, prompt, params)
        results = drive_checked(engine)
        assert {rid: c.token_ids for rid, c in results.items()} == reference, cut
        proposed[cut] = engine.stats()["spec_proposed_tokens"]
    assert 0 < proposed[True] < proposed[False]
    for tokens in reference.values():
        assert_follows_schema(decode(tokens))


def test_requests_without_a_constraint_build_no_grammar(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    engine.add_request("r", random_prompts([8], seed=13)[0], SamplingParams(max_tokens=8))
    drive(engine)
    assert engine.runner.grammar_masks is None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bias_allows_exactly_the_tokens_of_the_bitmask(dtype, device):
    """Unpacked where the bitmask is: on the host on a CPU, on the device on CUDA."""
    generator = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(1 << 31), 1 << 31, (3, 4), dtype=torch.int64, generator=generator)
    bitmask = bitmask.to(torch.int32)
    bitmask[1] = -1  # all allowed (bit 31 is the sign)
    bias = bias_from_bitmask(bitmask.to(device), 120, dtype)  # 120 of the 128 bits are tokens
    assert bias.shape == (3, 120) and bias.dtype == dtype and bias.device.type == device
    bias = bias.cpu()
    for row in range(3):
        for token in range(120):
            allowed = (int(bitmask[row, token // 32]) >> (token % 32)) & 1
            assert bias[row, token].item() == (0.0 if allowed else float("-inf")), (row, token)


@pytest.mark.timeout(300)
def test_tensor_parallel_ranks_follow_the_same_grammar(tiny_llama_dir, decode):
    """Every rank keeps its own copy of the tokens it feeds the model, so every rank must mask
    alike; with two ranks the constrained output equals one rank's."""
    prompts = dict(zip("ab", random_prompts([6, 11], seed=14), strict=True))
    results = {}
    for tp in (1, 2):
        engine = make_engine(tiny_llama_dir, tensor_parallel_size=tp, num_threads=1)
        try:
            for rid, prompt in prompts.items():
                engine.add_request(rid, prompt, sampled(JSON, seed=4))
            results[tp] = {rid: c.token_ids for rid, c in drive(engine).items()}
        finally:
            engine.close()
    assert results[2] == results[1]
    for tokens in results[1].values():
        assert_follows_schema(decode(tokens))


def test_the_first_constrained_step_does_not_import_torch_dynamo(tiny_llama_dir):
    """Masks are filled by llguidance's executor directly: importing llguidance.torch, which
    imports torch._dynamo, took 1.6 s on the engine thread at a worker's first constrained
    step, stalling every stream on it (and teaching the gateway's TTFT line a slow first
    token). Checked in a fresh process, since other tests import torch._dynamo."""
    script = (
        "import sys\n"
        "from engine_harness import drive, make_engine\n"
        "from engine.sampling_params import SamplingParams, StructuredOutput\n"
        f"engine = make_engine({str(tiny_llama_dir)!r})\n"
        "engine.add_request('r', [5, 6, 7], SamplingParams(max_tokens=4, temperature=1.0, seed=1,"
        f" structured_output=StructuredOutput(regex={REGEX!r})))\n"
        "drive(engine)\n"
        "print(engine.runner.grammar_masks is not None, 'torch._dynamo' in sys.modules)\n")
    here = Path(__file__).parent
    done = subprocess.run([sys.executable, "-c", script], cwd=here.parents[1], text=True,
                          capture_output=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(here)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "False"], done.stdout


def test_an_idle_engine_warms_structured_outputs_once_and_not_when_told_not_to(tiny_llama_dir,
                                                                              decode):
    """LLMEngine.warm_structured_outputs (the engine loop's first idle work): it builds the
    grammar side a first constrained request would wait for, once; then that request is served
    under its grammar as usual. structured_outputs_warmup=False leaves it to that request."""
    engine = make_engine(tiny_llama_dir)
    assert engine.runner.grammar_masks is None
    assert engine.warm_structured_outputs() is True
    masks = engine.runner.grammar_masks
    assert masks is not None and masks.compiler._tokenizer is not None
    assert engine.warm_structured_outputs() is False
    engine.add_request("r", [5, 6, 7], sampled(StructuredOutput(regex=REGEX), seed=2))
    assert re.fullmatch(REGEX, decode(drive(engine)["r"].token_ids))
    assert engine.runner.grammar_masks is masks
    assert_no_leak(engine)

    off = make_engine(tiny_llama_dir, structured_outputs_warmup=False)
    assert off.warm_structured_outputs() is False
    assert off.runner.grammar_masks is None
