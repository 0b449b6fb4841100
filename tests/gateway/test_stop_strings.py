"""Stop strings over streamed text: matched across pushes, never released, and text that
merely looks like the start of one is released once it is clearly not."""

from __future__ import annotations

from services.gateway.api.stop_strings import StopStringMatcher


def _run(stop, pieces):
    matcher = StopStringMatcher(stop)
    released = [matcher.push(p) for p in pieces]
    if not matcher.stopped:
        released.append(matcher.flush())
    return released, matcher.stopped


def test_stop_string_split_across_pushes_is_never_released():
    released, stopped = _run(["STOP"], ["Hel", "lo S", "T", "OP there"])
    assert stopped
    assert "".join(released) == "Hello "
    assert not any("S" in r for r in released)


def test_possible_prefix_is_held_back_then_released_when_it_is_not_a_match():
    matcher = StopStringMatcher(["abc"])
    assert matcher.push("xxa") == "xx"
    assert matcher.push("b") == ""
    assert matcher.push("d") == "abd"
    assert not matcher.stopped


def test_held_text_is_released_at_the_end_of_the_output():
    released, stopped = _run(["</end>"], ["final </en"])
    assert not stopped and "".join(released) == "final </en"


def test_earliest_of_several_stop_strings_wins():
    released, stopped = _run(["world", "lo w"], ["Hello world"])
    assert stopped and "".join(released) == "Hel"


def test_match_at_the_very_start_releases_nothing():
    released, stopped = _run(["\n\n"], ["\n", "\nrest"])
    assert stopped and "".join(released) == ""


def test_overlapping_prefixes_are_matched():
    released, stopped = _run(["aab"], ["a", "a", "a", "b", "c"])
    assert stopped and "".join(released) == "a"


def test_nothing_is_released_after_a_match():
    matcher = StopStringMatcher(["x"])
    assert matcher.push("axb") == "a"
    assert matcher.push("more") == "" and matcher.flush() == ""


def test_without_stop_strings_text_passes_straight_through():
    matcher = StopStringMatcher([])
    assert matcher.push("anything") == "anything" and matcher.flush() == ""


def test_multibyte_stop_strings():
    released, stopped = _run(["🙂"], ["東京 ", "🙂", " after"])
    assert stopped and "".join(released) == "東京 "
