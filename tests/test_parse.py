import pytest

from infermux._parse import parse_batches, parse_duration_s, parse_shape
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
