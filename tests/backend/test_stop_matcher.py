"""Stop sequences on text, across pieces, with hold-back."""

from backend.engine.stop_matcher import StopMatcher


def feed_all(matcher, pieces):
    return [matcher.feed(piece) for piece in pieces]


def test_a_stop_spanning_pieces_is_found_and_never_sent():
    matcher = StopMatcher(["###"])
    released = feed_all(matcher, ["Hello #", "#", "# world"])
    assert "".join(released) == "Hello "
    assert matcher.stopped
    assert all("#" not in piece for piece in released)


def test_a_possible_start_is_held_back_then_released_when_it_is_not_a_stop():
    matcher = StopMatcher(["\nUser:"])
    assert matcher.feed("Hi\nUs") == "Hi"  # "\nUs" might begin the stop
    assert matcher.feed("eful") == "\nUseful"
    assert not matcher.stopped


def test_a_stop_asked_for_in_the_output_ends_it_and_what_followed_it_is_cut():
    matcher = StopMatcher(["###"], include=True)
    released = feed_all(matcher, ["Hello #", "#", "# world"])
    assert "".join(released) == "Hello ###" and matcher.matched == "###"
    assert matcher.feed("more") == ""


def test_the_earliest_of_several_stops_wins_and_is_named():
    matcher = StopMatcher(["END", "."])
    assert matcher.feed("one. two END") == "one"
    assert matcher.matched == "."


def test_of_stops_found_at_the_same_place_the_first_listed_is_named():
    matcher = StopMatcher(["ab", "abc"])
    assert matcher.feed("xx abc") == "xx "
    assert matcher.matched == "ab"
    assert StopMatcher(["never"]).matched is None


def test_flush_releases_what_was_held_back():
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("almost ST") == "almost "
    assert matcher.flush() == "ST"


def test_nothing_is_released_after_a_stop():
    matcher = StopMatcher(["x"])
    matcher.feed("ax")
    assert matcher.feed("more") == ""


def test_no_stops_passes_text_through():
    matcher = StopMatcher([])
    assert matcher.feed("abc") == "abc"
