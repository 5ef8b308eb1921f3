import pytest

from trainer.contract.config import ConfigError
from tuner.budget import Budget, format_duration, parse_duration


@pytest.mark.parametrize(
    "text,seconds",
    [
        ("90s", 90),
        ("30m", 1800),
        ("1h30m", 5400),
        ("2h", 7200),
        ("45s", 45),
        ("1.5h", 5400),
        ("1d", 86400),
        ("1h30m15s", 5415),
        (" 2H ", 7200),
        ("0.5m", 30),
        (120, 120),
    ],
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("", "empty"),
        ("0s", "positive"),
        ("-5m", "positive"),
        ("5x", "unknown unit 'x'"),
        ("2", "'2' has no unit"),
        ("0", "has no unit"),
        ("1.5", "e.g. 1.5s or 1.5m"),
        (" 45 ", "has no unit"),
        ("30m1h", "'1h' is out of order"),
        ("1h1h", "out of order or repeated"),
        ("1h30", "cannot read '30'"),
        ("abc", "cannot read 'abc'"),
    ],
)
def test_parse_duration_errors_name_the_option_and_part(text, fragment):
    with pytest.raises(ConfigError) as e:
        parse_duration(text)
    assert e.value.option == "--budget"
    assert fragment in str(e.value)


def test_format_duration():
    assert format_duration(5400) == "1h30m"
    assert format_duration(270) == "4m30s"
    assert format_duration(12.4) == "12s"


def test_budget_with_fake_clock():
    now = [100.0]
    b = Budget(60, clock=lambda: now[0])
    assert b.left() == 60 and not b.expired()  # nothing spent before start
    b.start()
    now[0] += 20
    b.start()  # idempotent
    assert b.elapsed() == 20 and b.left() == 40
    assert b.can_afford(40) and not b.can_afford(41)
    now[0] += 50
    assert b.left() == 0 and b.expired()
    with pytest.raises(ConfigError):
        Budget(0)
