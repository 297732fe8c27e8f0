from tandem.frontend.stop import StopStringMatcher


def feed_all(stops, pieces):
    m = StopStringMatcher(stops)
    out = "".join(m.feed(p) for p in pieces)
    return out + m.flush(), m.stopped


def test_stop_string_split_over_three_deltas_is_removed_with_the_rest():
    assert feed_all(["END"], ["abc E", "N", "Dxyz"]) == ("abc ", True)


def test_text_that_only_looks_like_a_stop_prefix_is_released():
    assert feed_all(["END"], ["abc E", "Nx", "yz"]) == ("abc ENxyz", False)


def test_earliest_of_several_stop_strings_wins():
    assert feed_all(["zz", "b"], ["azzb"]) == ("a", True)


def test_no_stop_strings_passes_text_through():
    m = StopStringMatcher([])
    assert m.feed("hello") == "hello" and m.flush() == ""
