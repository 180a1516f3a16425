import pytest

from infermux._parse import (
    parse_batches,
    parse_duration_s,
    parse_latency_ms,
    parse_shape,
)
from infermux.errors import UsageError


@pytest.mark.parametrize(("text", "seconds"), [
    ("10s", 10.0), ("500ms", 0.5), ("2m", 120.0), ("1.5", 1.5), (" 3 s ", 3.0), ("1h", 3600.0),
])
def test_durations(text, seconds):
    assert parse_duration_s(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["ten", "10x", "-1s", "", "s"])
def test_bad_durations_name_the_value(text):
    with pytest.raises(UsageError, match="duration"):
        parse_duration_s(text)


def test_batches():
    assert parse_batches("1,8, 64") == [1, 8, 64]
    for bad in ("0", "-4", "a", ""):
        with pytest.raises(UsageError, match="batch"):
            parse_batches(bad)


def test_shapes():
    assert parse_shape("3x224x224") == (3, 224, 224)
    assert parse_shape("16") == (16,)
    for bad in ("3xAx4", "0x3", ""):
        with pytest.raises(UsageError, match="input shape"):
            parse_shape(bad)


@pytest.mark.parametrize(("text", "ms"), [("15", 15.0), ("15ms", 15.0), ("0.015s", 15.0),
                                          (" 2.5 ", 2.5), ("1m", 60_000.0), (15, 15.0)])
def test_a_latency_bound_is_ms_whether_or_not_it_says_so(text, ms) -> None:
    assert parse_latency_ms(text) == pytest.approx(ms)


@pytest.mark.parametrize(("text", "needle"), [("soon", "is not a duration"), ("0", "must be above 0"),
                                              ("0ms", "must be above 0"), ("-3", "is not a duration")])
def test_a_bad_latency_bound_is_one_line(text, needle) -> None:
    with pytest.raises(UsageError, match=needle):
        parse_latency_ms(text)
