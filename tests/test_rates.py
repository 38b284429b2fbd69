"""One rule for every rate: the same interval check and message wherever a rate enters."""

import math

import pytest

import shadow
from shadow.core.calls.gate.sampling import Sampler
from shadow.core.calls.sampled.drill import Drill
from shadow.core.support.rates import check_rate, parse_rate
from shadow.launcher import config as cfg
from shadow.launcher.cli import main


@pytest.mark.parametrize("value", [0, 0.5, 1, 1.0])
def test_rates_in_the_closed_interval(value):
    assert check_rate(value, "x") == float(value)


@pytest.mark.parametrize("value", [-0.1, 1.5, math.nan, math.inf, True, "0.5", None])
def test_anything_else_names_the_setting_and_the_interval(value):
    with pytest.raises(ValueError, match=r"^x: expected a number in \[0, 1\], got "):
        check_rate(value, "x")


def test_open_ends_and_text():
    with pytest.raises(ValueError, match=r"budget: expected a number in \(0, 1\], got 0"):
        check_rate(0, "budget", low="(0")
    with pytest.raises(ValueError, match=r"\(0, 1\)"):
        check_rate(1.0, "max", low="(0", high="1)")
    assert parse_rate(" 0.25", "x") == 0.25
    with pytest.raises(ValueError, match=r"x: expected a number in \[0, 1\], got 'often'"):
        parse_rate("often", "x")


def test_every_entry_uses_the_rule(capsys):
    with pytest.raises(ValueError, match=r"sample rate: expected a number in \[0, 1\]"):
        Sampler(1.5, None, "t", lambda gate: None)
    with pytest.raises(ValueError, match=r"drill rate: expected a number in \[0, 1\]"):
        Drill("value", math.nan)
    with pytest.raises(ValueError, match=r"oracle: expected a number in \[0, 1\]"):
        shadow.install(["tensor_type"], oracle=2)
    with pytest.raises(ValueError, match=r"budget: expected a number in \(0, 1\]"):
        shadow.install(["tensor_type"], budget=0)
    for name, text in (("sample_rate", "nan"), ("budget", "0"), ("oracle", "-1"), ("drill", "value:2")):
        with pytest.raises(cfg.ConfigError, match=cfg.SETTINGS[name].variable):
            cfg.from_sources({cfg.SETTINGS[name].variable: text})
    with pytest.raises(SystemExit):
        main(["verdict", "--max-rate", "1", "--metrics-file", "/nonexistent"])
    assert "argument --max-rate: expected a number in (0, 1), got '1'" in capsys.readouterr().err
