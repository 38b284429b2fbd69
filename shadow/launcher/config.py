"""Settings from environment variables (and the launcher's options, which set the same variables).

Every value is checked when it is read, so a wrong setting fails at start-up with a message that names
the variable (or the option) and what it accepts, never halfway through training.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import string
from collections.abc import Mapping

from shadow.core.drill import DRILL_KINDS
from shadow.core.rates import parse_rate
from shadow.core.safe_paths import directory_problem, long_component
from shadow.core.targets import BUILTINS


class ConfigError(ValueError):
    """A setting has a value it cannot have; the message names the setting."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """One setting: its variable, its launcher option, and what it accepts (for messages)."""

    variable: str
    option: str
    accepts: str


SETTINGS = {
    "targets": Setting("NPU_SHADOW_TARGETS", "--targets", f"a comma list of {', '.join(sorted(BUILTINS))}"),
    "sample_rate": Setting(
        "NPU_SHADOW_SAMPLE_RATE", "--sample-rate", "a number in [0, 1], or target=rate pairs separated by commas"
    ),
    "seed": Setting("NPU_SHADOW_SEED", "--seed", "an integer"),
    "rtol": Setting("NPU_SHADOW_RTOL", "--rtol", "a finite number >= 0 (set together with atol)"),
    "atol": Setting("NPU_SHADOW_ATOL", "--atol", "a finite number >= 0 (set together with rtol)"),
    "port": Setting("NPU_SHADOW_PROMETHEUS_PORT", "--port", "a port number in 0..65535 (LOCAL_RANK is added)"),
    "addr": Setting("NPU_SHADOW_PROMETHEUS_ADDR", "--addr", "an address to bind, e.g. 127.0.0.1"),
    "multiproc_dir": Setting(
        "NPU_SHADOW_MULTIPROC_DIR",
        "--multiproc-dir",
        "a directory of yours that no one else can write (each job gets a fresh folder inside it)",
    ),
    "otel": Setting("NPU_SHADOW_OTEL", "--otel", "1/true/yes or 0/false/no"),
    "journal": Setting("NPU_SHADOW_JOURNAL", "--journal", "a file path ({rank} and {pid} allowed)"),
    "capture_dir": Setting(
        "NPU_SHADOW_CAPTURE_DIR", "--capture-dir", "a directory path of yours that no one else can write"
    ),
    "drill": Setting(
        "NPU_SHADOW_DRILL", "--drill", f"KIND:RATE with KIND one of {', '.join(DRILL_KINDS)}, RATE in [0, 1]"
    ),
    "pushgateway": Setting("NPU_SHADOW_PUSHGATEWAY", "--pushgateway", "a Pushgateway address, e.g. 127.0.0.1:9091"),
    "textfile": Setting(
        "NPU_SHADOW_TEXTFILE", "--textfile", "a file path for the exposition written at exit ({rank} and {pid} allowed)"
    ),
    "emulate_npu": Setting(
        "NPU_SHADOW_EMULATE_NPU", "--emulate-npu", "a number of emulated npu devices, 1..16 (0 or empty: none)"
    ),
    "legacy_from": Setting(
        "NPU_SHADOW_LEGACY_FROM",
        "--legacy-from",
        "a torch_npu wheel file, a directory holding the torch_npu package, or 'installed'",
    ),
    "budget": Setting(
        "NPU_SHADOW_BUDGET",
        "--budget",
        "'off', or the fraction in (0, 1] of the job's wall time the shadow side may use per target (default 0.2)",
    ),
    "oracle": Setting(
        "NPU_SHADOW_ORACLE",
        "--oracle",
        "'off', or the fraction in [0, 1] of sampled DataParallel calls without autocast also checked against "
        "replica 0 alone on its device (calls under autocast always are; default 0.1)",
    ),
}


@dataclasses.dataclass(frozen=True)
class Config:
    """The monitor's settings, checked."""

    targets: tuple[str, ...] | None = None
    sample_rate: float | dict[str, float] = 0.01
    seed: int | None = None
    rtol: float | None = None
    atol: float | None = None
    port: int | None = None
    addr: str = "127.0.0.1"
    multiproc_dir: str | None = None
    otel: bool = False
    journal: str | None = None
    capture_dir: str | None = None
    drill: tuple[str, float] | None = None
    pushgateway: str | None = None
    textfile: str | None = None
    emulate_npu: int = 0
    legacy_from: str | None = None
    oracle: float | None = 0.1
    budget: float | None = 0.2


def _fail(name: str, value: str, by_option: bool, why: str = "") -> ConfigError:
    setting = SETTINGS[name]
    which = setting.option if by_option else setting.variable
    return ConfigError(f"{which}={value!r} is not valid{': ' + why if why else ''}; expected {setting.accepts}")


def _rate(text: str, low: str = "[0") -> float | None:
    try:
        return parse_rate(text, "rate", low=low)
    except ValueError:
        return None


def _parse(name: str, text: str, by_option: bool) -> object:
    text = text.strip()
    if name == "targets":
        names = tuple(t.strip() for t in text.split(",") if t.strip())
        unknown = [t for t in names if t not in BUILTINS]
        if not names or unknown:
            raise _fail(name, text, by_option, f"unknown target {unknown[0]!r}" if unknown else "empty")
        return names
    if name == "sample_rate":
        if "=" not in text:
            rate = _rate(text)
            if rate is None:
                raise _fail(name, text, by_option)
            return rate
        table = {}
        for pair in text.split(","):
            target, _, rate_text = pair.partition("=")
            rate = _rate(rate_text)
            if target.strip() not in BUILTINS or rate is None:
                raise _fail(name, text, by_option, f"bad pair {pair!r}")
            table[target.strip()] = rate
        return table
    if name == "seed":
        try:
            return int(text)
        except ValueError:
            raise _fail(name, text, by_option) from None
    if name in ("rtol", "atol"):
        try:
            value = float(text)
        except ValueError:
            raise _fail(name, text, by_option) from None
        if not math.isfinite(value) or value < 0:
            raise _fail(name, text, by_option)
        return value
    if name == "port":
        if not (text.isascii() and text.isdigit()) or int(text) > 65535:
            raise _fail(name, text, by_option)
        return int(text)
    if name == "emulate_npu":
        if text in ("", "0"):
            return 0
        if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= 16:
            raise _fail(name, text, by_option)
        return int(text)
    if name == "budget":
        if text.lower() == "off":
            return None
        rate = _rate(text, low="(0")
        if rate is None:
            raise _fail(name, text, by_option)
        return rate
    if name == "oracle":
        if text.lower() == "off":
            return None
        rate = _rate(text)
        if rate is None:
            raise _fail(name, text, by_option)
        return rate
    if name == "legacy_from":
        if text != "installed" and not os.path.exists(text):
            raise _fail(name, text, by_option, "no such file or directory")
        return text
    if name == "otel":
        lowered = text.lower()
        if lowered not in ("1", "true", "yes", "0", "false", "no", ""):
            raise _fail(name, text, by_option)
        return lowered in ("1", "true", "yes")
    if name == "drill":
        kind, _, rate_text = text.partition(":")
        rate = _rate(rate_text)
        if kind not in DRILL_KINDS or rate is None:
            raise _fail(name, text, by_option)
        return (kind, rate)
    if name == "addr":
        if not _ADDRESS.fullmatch(text):
            raise _fail(name, text, by_option)
        return text
    if name == "pushgateway":
        if not _GATEWAY.fullmatch(text):
            raise _fail(name, text, by_option)
        return text
    if not text:
        raise _fail(name, text, by_option, "empty")
    too_long = long_component(text)
    if too_long is not None:
        raise _fail(name, text, by_option, f"a name of {len(too_long)} characters is longer than a file name can be")
    if name in ("journal", "textfile"):
        _check_template(name, text, by_option)
    if name in ("multiproc_dir", "capture_dir"):
        problem = directory_problem(text)
        if problem is not None:
            raise _fail(name, text, by_option, problem)
    # written later, so their folder must be creatable now (the launcher creates the directories at start)
    folder = text if name in ("multiproc_dir", "capture_dir") else os.path.dirname(os.path.abspath(text))
    if not _creatable(folder):
        raise _fail(name, text, by_option, f"cannot create or write {folder}")
    return text


def _check_template(name: str, text: str, by_option: bool) -> None:
    """A path template may name {pid} and {rank}, nothing else (a bad one would fail in every process)."""
    try:
        fields = {field for _, field, _, _ in string.Formatter().parse(text) if field is not None}
    except ValueError as exc:
        raise _fail(name, text, by_option, f"bad template: {exc}") from None
    unknown = sorted(fields - {"pid", "rank"})
    if unknown:
        raise _fail(name, text, by_option, f"unknown field {{{unknown[0]}}}: only {{pid}} and {{rank}}")


_ADDRESS = re.compile(r"[A-Za-z0-9.\-]+|\[?[0-9A-Fa-f:]+\]?")
_GATEWAY = re.compile(r"(https?://)?[A-Za-z0-9.\-]+(:\d{1,5})?(/\S*)?")


def _creatable(folder: str) -> bool:
    """Whether ``folder`` exists as a writable directory or could be made (its nearest existing
    ancestor is a writable directory)."""
    path = folder
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return False
        path = parent
    return os.path.isdir(path) and os.access(path, os.W_OK)


def from_sources(environ: Mapping[str, str], options: Mapping[str, str | None] | None = None) -> Config:
    """Settings from the environment, each overridden by its option when given. Raises ConfigError."""
    values: dict[str, object] = {}
    for name, setting in SETTINGS.items():
        option_value = (options or {}).get(name)
        if option_value is not None:
            values[name] = _parse(name, option_value, by_option=True)
        elif setting.variable in environ:
            values[name] = _parse(name, environ[setting.variable], by_option=False)
    if ("rtol" in values) != ("atol" in values):
        given = "rtol" if "rtol" in values else "atol"
        missing = SETTINGS["atol" if given == "rtol" else "rtol"]
        raise ConfigError(f"{SETTINGS[given].option} needs {missing.option} ({missing.variable}) too")
    return Config(**values)  # type: ignore[arg-type]


def to_environ(options: Mapping[str, str | None]) -> dict[str, str]:
    """The variables that carry the given options to the job's processes."""
    return {SETTINGS[name].variable: value for name, value in options.items() if value is not None}
