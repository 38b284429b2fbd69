"""The values a setting can take, read from text: each parser returns the value or raises :class:`Invalid` saying
why (:mod:`shadow.launcher.config` names the setting around it). Targets, rates, seconds, ports, tokens and token
files, paths the launcher will write, a release's source, an emulated device's properties."""

from __future__ import annotations

import math
import os
import re
import tempfile
from collections.abc import Callable

from shadow.core.model.observation import ARM_TARGETS, BUILTIN_TARGETS, DRILL_KINDS
from shadow.core.model.run_ids import run_id_problem, unix_time_problem
from shadow.core.support.rates import parse_rate
from shadow.core.support.safe_paths import directory_problem, long_component, template_problem

#: Every target name the settings accept: the shadowed ones and the canary A/B's.
BUILTINS = (*BUILTIN_TARGETS, *ARM_TARGETS)


class Invalid(ValueError):
    """Raised by a setting's parser: the value is not valid (``why``, when given, says more)."""

    def __init__(self, why: str = "") -> None:
        super().__init__(why)
        self.why = why


def targets(text: str) -> tuple[str, ...]:
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [t for t in names if t not in BUILTINS]
    if unknown:
        raise Invalid(f"unknown target {unknown[0]!r}")
    if not names:
        raise Invalid("empty")
    repeated = sorted({t for t in names if names.count(t) > 1})
    if repeated:
        raise Invalid(f"{repeated[0]!r} given more than once")
    return names


def dotted_names(text: str) -> tuple[str, ...]:
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    if not names:
        raise Invalid("empty")
    bad = [n for n in names if not re.fullmatch(r"torch(\.[A-Za-z_][A-Za-z0-9_]*)+", n)]
    if bad:
        raise Invalid(f"{bad[0]!r} is not a dotted name of torch (torch.serialization.save)")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise Invalid(f"{repeated[0]!r} given more than once")
    return names


def rate(text: str, low: str = "[0") -> float:
    try:
        return parse_rate(text, "rate", low=low)
    except ValueError:
        raise Invalid() from None


def sample_rate(text: str) -> float | dict[str, float]:
    if "=" not in text:
        return rate(text)
    table = {}
    for pair in text.split(","):
        target, _, rate_text = pair.partition("=")
        try:
            value = rate(rate_text)
        except Invalid:
            value = None
        if target.strip() not in BUILTINS or value is None:
            raise Invalid(f"bad pair {pair!r}")
        table[target.strip()] = value
    return table


def off_or_seconds(text: str) -> float | None:
    if text.lower() == "off":
        return None
    try:
        seconds = float(text)
    except ValueError:
        raise Invalid() from None
    if not 0 < seconds < math.inf:
        raise Invalid("seconds > 0")
    return seconds


def seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise Invalid() from None
    if not 0 <= seconds < math.inf:
        raise Invalid("seconds >= 0")
    return seconds


def run_id(text: str) -> str:
    problem = run_id_problem(text)
    if problem:
        raise Invalid(problem)
    return text


def unix_time(text: str) -> float:
    problem = unix_time_problem(text)
    if problem:
        raise Invalid(problem)
    return float(text)


def off_or_rate(low: str) -> Callable[[str], float | None]:
    def parse(text: str) -> float | None:
        return None if text.lower() == "off" else rate(text, low)

    return parse


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise Invalid() from None


def tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise Invalid() from None
    if not math.isfinite(value) or value < 0:
        raise Invalid()
    return value


def port(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) > 65535:
        raise Invalid()
    return int(text)


def choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in allowed:
            raise Invalid()
        return text

    return parse


def nonempty(text: str) -> str:
    if not text:
        raise Invalid()
    return text


#: What a bearer token must be (the jobs' switch token, the receiver's).
TOKEN_RULE = "at least 16 printable ASCII characters, no spaces"


def token_problem(text: str) -> str | None:
    """Why ``text`` cannot be a bearer token, or None."""
    if len(text) < 16 or not text.isascii() or not text.isprintable() or " " in text:
        return "is too short, or has spaces, control or non-ASCII characters"
    return None


#: The most a token file may hold (the token and a newline).
MAX_TOKEN_BYTES = 4096


def read_token_file(path: str) -> str:
    """The token in ``path``: a regular file of this user's own that no one else can read or write. Raises
    Invalid saying what is wrong."""
    import stat as stat_module

    from shadow.core.support.safe_paths import open_own_file

    try:
        fd = open_own_file(path, os.O_RDONLY)
    except OSError as exc:
        raise Invalid(str(exc)) from None
    with os.fdopen(fd, "rb") as handle:
        if os.fstat(handle.fileno()).st_mode & (stat_module.S_IRGRP | stat_module.S_IROTH):
            raise Invalid("others can read it (chmod 600)")
        data = handle.read(MAX_TOKEN_BYTES + 1)
    if len(data) > MAX_TOKEN_BYTES:
        raise Invalid(f"it holds more than {MAX_TOKEN_BYTES} bytes: a token file holds the token alone")
    try:
        token = data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise Invalid("the token in it is not ASCII text") from None
    problem = token_problem(token)
    if problem:
        raise Invalid(f"the token in it {problem}")
    return token


def token_file(text: str) -> str:
    read_token_file(text)
    return text


def token(text: str) -> str:
    if token_problem(text):
        raise Invalid("too short, or with spaces, control or non-ASCII characters")
    return text


def non_negative(text: str) -> int:
    if not (text.isascii() and text.isdigit()):
        raise Invalid()
    return int(text)


def device_count(text: str) -> int:
    if text in ("", "0"):
        return 0
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= 16:
        raise Invalid()
    return int(text)


#: ``--legacy-from reference``: shadow.npu.reference's legacy, a rehearsal on a host without torch_npu.
REFERENCE = "reference"


def soc(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", text):
        raise Invalid("not a SoC name (1 to 64 letters, digits, '_' or '-')")
    return text


def device_properties(text: str) -> str:
    from shadow.npu.device_properties import DeviceProperties

    try:
        DeviceProperties.parse(text)
    except ValueError as exc:
        raise Invalid(str(exc)) from None
    return text


def legacy_source(text: str) -> str:
    """A release's source: as given, or a version whose wheel is in the cache (``2.14.0``: as census takes it),
    turned into that wheel's path so that every process of the job reads the same file."""
    if text in ("installed", REFERENCE) or os.path.exists(text):
        return text
    from shadow.npu.wheels import cached_wheel

    cached = cached_wheel(text) if re.fullmatch(r"\d+(\.\d+){1,3}(rc\d+)?", text) else None
    if cached is None:
        raise Invalid("no such file or directory, nor a version whose wheel is cached (scripts/fetch_torch_npu.sh)")
    return str(cached)


def flag(text: str) -> bool:
    lowered = text.lower()
    if lowered not in ("1", "true", "yes", "0", "false", "no", ""):
        raise Invalid()
    return lowered in ("1", "true", "yes")


def drill(text: str) -> tuple[str, float]:
    kind, _, rate_text = text.partition(":")
    value = rate(rate_text)
    if kind not in DRILL_KINDS:
        raise Invalid()
    return (kind, value)


def matching(pattern: re.Pattern[str]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if not pattern.fullmatch(text):
            raise Invalid()
        return text

    return parse


def path(text: str) -> str:
    """A path we will write: not empty, no component longer than a file name can be."""
    if not text:
        raise Invalid("empty")
    too_long = long_component(text)
    if too_long is not None:
        raise Invalid(f"a name of {len(too_long)} characters is longer than a file name can be")
    return text


def file_template(text: str) -> str:
    """A file written later in every process: may name {pid} and {rank}, nothing else; its folder creatable now."""
    problem = template_problem(text)
    if problem is not None:
        raise Invalid(problem)
    creatable(os.path.dirname(os.path.abspath(text)))
    return text


def private_directory(text: str) -> str:
    """A directory of the user's own (the launcher creates it at start, so it must be creatable now)."""
    path(text)
    problem = directory_problem(text)
    if problem is not None:
        raise Invalid(problem)
    creatable(text)
    return text


def creatable(folder: str) -> None:
    """Raise Invalid unless ``folder`` exists as a writable directory or could be made (its nearest existing
    ancestor is a writable directory)."""
    path = folder
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    if not (os.path.isdir(path) and os.access(path, os.W_OK)):
        raise Invalid(f"cannot create or write {folder}")
    try:  # (a folder of a kernel filesystem, /sys or /proc, says it is writable and takes no file)
        handle, probe = tempfile.mkstemp(prefix=".npu-shadow-probe-", dir=path)
        os.close(handle)
        os.unlink(probe)
    except OSError as exc:
        raise Invalid(f"cannot create it: no file can be made in {path} ({exc.strerror or exc})") from None


ADDRESS = re.compile(r"[A-Za-z0-9.\-]+|\[?[0-9A-Fa-f:]+\]?")


GATEWAY = re.compile(r"(https?://)?[A-Za-z0-9.\-]+(:\d{1,5})?(/\S*)?")
