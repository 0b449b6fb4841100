"""bench/api_parity.py's comparison: key paths of JSON answers and SSE streams, and which keys
one side lacks (pure functions; the benchmark itself starts vLLM and splitserve)."""

from __future__ import annotations

from bench.api_parity import Answer, cases, compare, shape, sse_shapes


def test_shape_names_every_key_path_and_not_the_values():
    body = {"choices": [{"index": 0, "message": {"content": "x"}},
                        {"index": 1, "logprobs": {"content": []}}],
            "prompt_logprobs": [None, {"9690": {"logprob": -1.0}}]}
    assert shape(body) == {".choices", ".choices[].index", ".choices[].message",
                           ".choices[].message.content", ".choices[].logprobs",
                           ".choices[].logprobs.content",
                           ".prompt_logprobs", ".prompt_logprobs[].<id>",
                           ".prompt_logprobs[].<id>.logprob"}
    assert shape({"a": 1}) == shape({"a": "two"})
    assert shape({"a": 1, "b": None}) == {".a"}  # null reads as absent


def test_a_stream_is_the_union_of_its_events_and_done_is_no_event():
    text = ('data: {"choices": [{"delta": {"role": "assistant"}}]}\n\n'
            'data: {"choices": [], "usage": {"total_tokens": 3}}\n\ndata: [DONE]\n\n')
    keys, events = sse_shapes(text)
    assert len(events) == 2
    assert {".choices[].delta.role", ".usage.total_tokens"} <= keys


def test_compare_reports_the_keys_each_side_lacks_and_a_status_class_change():
    names = [case.name for case in cases()]
    peer = {name: Answer(200, {".a", ".b"}) for name in names}
    ours = {name: Answer(200, {".a", ".c"}) for name in names}
    ours[names[0]] = Answer(400, {".error"})
    rows = compare(peer, ours)
    assert rows[1]["only_peer"] == [".b"] and rows[1]["only_ours"] == [".c"]
    assert rows[1]["same_status_class"] and not rows[0]["same_status_class"]
