"""Settings from environment variables (and the launcher's options, which set the same variables).

Every value is checked when it is read, so a wrong setting fails at start-up with a message that names
the variable (or the option) and what it accepts, never halfway through training.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

from shadow.core.calls.gate.budget import DEFAULT_DEADLINE
from shadow.core.model.observation import ARM_TARGETS, BUILTIN_TARGETS, DEFAULT_FIRST_PER_SIGNATURE, DRILL_KINDS
from shadow.core.model.run_ids import RUN_ID_VARIABLE, RUN_STARTED_VARIABLE, run_id_problem, unix_time_problem
from shadow.core.support.rates import parse_rate
from shadow.core.support.safe_paths import directory_problem, long_component, template_problem

#: Every target name the settings accept: the shadowed ones and the canary A/B's.
BUILTINS = (*BUILTIN_TARGETS, *ARM_TARGETS)

#: How long the launcher keeps the metrics endpoint up after the job, by default: one scrape at Prometheus'
#: default interval (1 min), with margin for a late one.
DEFAULT_LINGER_SECONDS = 75.0


class ConfigError(ValueError):
    """A setting has a value it cannot have; the message names the setting."""


class Invalid(ValueError):
    """Raised by a setting's parser: the value is not valid (``why``, when given, says more)."""

    def __init__(self, why: str = "") -> None:
        super().__init__(why)
        self.why = why


# --------------------------------------------------------------------------- parsers: text -> value, or Invalid


def _targets(text: str) -> tuple[str, ...]:
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


def _dotted_names(text: str) -> tuple[str, ...]:
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


def _rate(text: str, low: str = "[0") -> float:
    try:
        return parse_rate(text, "rate", low=low)
    except ValueError:
        raise Invalid() from None


def _sample_rate(text: str) -> float | dict[str, float]:
    if "=" not in text:
        return _rate(text)
    table = {}
    for pair in text.split(","):
        target, _, rate_text = pair.partition("=")
        try:
            rate = _rate(rate_text)
        except Invalid:
            rate = None
        if target.strip() not in BUILTINS or rate is None:
            raise Invalid(f"bad pair {pair!r}")
        table[target.strip()] = rate
    return table


def _off_or_seconds(text: str) -> float | None:
    if text.lower() == "off":
        return None
    try:
        seconds = float(text)
    except ValueError:
        raise Invalid() from None
    if not 0 < seconds < math.inf:
        raise Invalid("seconds > 0")
    return seconds


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise Invalid() from None
    if not 0 <= seconds < math.inf:
        raise Invalid("seconds >= 0")
    return seconds


def _run_id(text: str) -> str:
    problem = run_id_problem(text)
    if problem:
        raise Invalid(problem)
    return text


def _unix_time(text: str) -> float:
    problem = unix_time_problem(text)
    if problem:
        raise Invalid(problem)
    return float(text)


def _off_or_rate(low: str) -> Callable[[str], float | None]:
    def parse(text: str) -> float | None:
        return None if text.lower() == "off" else _rate(text, low)

    return parse


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise Invalid() from None


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise Invalid() from None
    if not math.isfinite(value) or value < 0:
        raise Invalid()
    return value


def _port(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) > 65535:
        raise Invalid()
    return int(text)


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in allowed:
            raise Invalid()
        return text

    return parse


def _nonempty(text: str) -> str:
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


def _token_file(text: str) -> str:
    read_token_file(text)
    return text


def _token(text: str) -> str:
    if token_problem(text):
        raise Invalid("too short, or with spaces, control or non-ASCII characters")
    return text


def _non_negative(text: str) -> int:
    if not (text.isascii() and text.isdigit()):
        raise Invalid()
    return int(text)


def _device_count(text: str) -> int:
    if text in ("", "0"):
        return 0
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= 16:
        raise Invalid()
    return int(text)


#: ``--legacy-from reference``: shadow.npu.reference's legacy, a rehearsal on a host without torch_npu.
REFERENCE = "reference"


def _soc(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", text):
        raise Invalid("not a SoC name (1 to 64 letters, digits, '_' or '-')")
    return text


def _device_properties(text: str) -> str:
    from shadow.npu.device_properties import DeviceProperties

    try:
        DeviceProperties.parse(text)
    except ValueError as exc:
        raise Invalid(str(exc)) from None
    return text


def _legacy_source(text: str) -> str:
    """A release's source: as given, or a version whose wheel is in the cache (``2.14.0``: as census takes it),
    turned into that wheel's path so that every process of the job reads the same file."""
    if text in ("installed", REFERENCE) or os.path.exists(text):
        return text
    from shadow.npu.wheels import cached_wheel

    cached = cached_wheel(text) if re.fullmatch(r"\d+(\.\d+){1,3}(rc\d+)?", text) else None
    if cached is None:
        raise Invalid("no such file or directory, nor a version whose wheel is cached (scripts/fetch_torch_npu.sh)")
    return str(cached)


def _flag(text: str) -> bool:
    lowered = text.lower()
    if lowered not in ("1", "true", "yes", "0", "false", "no", ""):
        raise Invalid()
    return lowered in ("1", "true", "yes")


def _drill(text: str) -> tuple[str, float]:
    kind, _, rate_text = text.partition(":")
    rate = _rate(rate_text)
    if kind not in DRILL_KINDS:
        raise Invalid()
    return (kind, rate)


def _matching(pattern: re.Pattern[str]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if not pattern.fullmatch(text):
            raise Invalid()
        return text

    return parse


def _path(text: str) -> str:
    """A path we will write: not empty, no component longer than a file name can be."""
    if not text:
        raise Invalid("empty")
    too_long = long_component(text)
    if too_long is not None:
        raise Invalid(f"a name of {len(too_long)} characters is longer than a file name can be")
    return text


def _file_template(text: str) -> str:
    """A file written later in every process: may name {pid} and {rank}, nothing else; its folder creatable now."""
    problem = template_problem(text)
    if problem is not None:
        raise Invalid(problem)
    _creatable(os.path.dirname(os.path.abspath(text)))
    return text


def _private_directory(text: str) -> str:
    """A directory of the user's own (the launcher creates it at start, so it must be creatable now)."""
    _path(text)
    problem = directory_problem(text)
    if problem is not None:
        raise Invalid(problem)
    _creatable(text)
    return text


def _creatable(folder: str) -> None:
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


_ADDRESS = re.compile(r"[A-Za-z0-9.\-]+|\[?[0-9A-Fa-f:]+\]?")
_GATEWAY = re.compile(r"(https?://)?[A-Za-z0-9.\-]+(:\d{1,5})?(/\S*)?")


# --------------------------------------------------------------------------- the settings


@dataclasses.dataclass(frozen=True)
class Setting:
    """One setting: its variable, its launcher option, what it accepts (for messages) and its parser."""

    variable: str
    option: str | None  # None: from the environment only (a secret)
    accepts: str
    parse: Callable[[str], object]

    def read(self, text: str, by_option: bool) -> object:
        """The value of ``text`` (stripped); ConfigError naming the option or the variable if it is not valid."""
        text = text.strip()
        try:
            return self.parse(text)
        except Invalid as exc:
            which = self.option if by_option else self.variable
            why = f": {exc.why}" if exc.why else ""
            raise ConfigError(f"{which}={text!r} is not valid{why}; expected {self.accepts}") from None


SETTINGS = {
    "targets": Setting("NPU_SHADOW_TARGETS", "--targets", f"a comma list of {', '.join(sorted(BUILTINS))}", _targets),
    "sample_rate": Setting(
        "NPU_SHADOW_SAMPLE_RATE",
        "--sample-rate",
        "a number in [0, 1], or target=rate pairs separated by commas",
        _sample_rate,
    ),
    "seed": Setting("NPU_SHADOW_SEED", "--seed", "an integer", _integer),
    "rtol": Setting("NPU_SHADOW_RTOL", "--rtol", "a finite number >= 0 (set together with atol)", _tolerance),
    "atol": Setting("NPU_SHADOW_ATOL", "--atol", "a finite number >= 0 (set together with rtol)", _tolerance),
    "port": Setting("NPU_SHADOW_PROMETHEUS_PORT", "--port", "a port number in 0..65535 (LOCAL_RANK is added)", _port),
    "addr": Setting("NPU_SHADOW_PROMETHEUS_ADDR", "--addr", "an address to bind, e.g. 127.0.0.1", _matching(_ADDRESS)),
    "multiproc_dir": Setting(
        "NPU_SHADOW_MULTIPROC_DIR",
        "--multiproc-dir",
        "a directory of yours that no one else can write (each job gets a fresh folder inside it)",
        _private_directory,
    ),
    "otel": Setting("NPU_SHADOW_OTEL", "--otel", "1/true/yes or 0/false/no", _flag),
    "journal": Setting("NPU_SHADOW_JOURNAL", "--journal", "a file path ({rank} and {pid} allowed)", _file_template),
    "gather": Setting(
        "NPU_SHADOW_GATHER",
        "--gather",
        "1/true/yes or 0/false/no: an evidence job (the --gather preset: docs/launcher.md)",
        _flag,
    ),
    "journal_all": Setting(
        "NPU_SHADOW_JOURNAL_ALL",
        "--journal-all",
        "1/true/yes or 0/false/no: the journal has a line for every comparison, matches too (by default matches "
        "are only counted, in its count records)",
        _flag,
    ),
    "capture_dir": Setting(
        "NPU_SHADOW_CAPTURE_DIR",
        "--capture-dir",
        "a directory path of yours that no one else can write",
        _private_directory,
    ),
    "drill": Setting(
        "NPU_SHADOW_DRILL",
        "--drill",
        f"KIND:RATE with KIND one of {', '.join(DRILL_KINDS)}, RATE in [0, 1]",
        _drill,
    ),
    "pushgateway": Setting(
        "NPU_SHADOW_PUSHGATEWAY",
        "--pushgateway",
        "a Pushgateway address, e.g. 127.0.0.1:9091",
        _matching(_GATEWAY),
    ),
    "textfile": Setting(
        "NPU_SHADOW_TEXTFILE",
        "--textfile",
        "a file path for the exposition written at exit ({rank} and {pid} allowed)",
        _file_template,
    ),
    "run_id": Setting(
        RUN_ID_VARIABLE,
        "--run-id",
        "a run id: 1 to 64 letters, digits, '.', '_', ':' or '-' (default: torchrun's TORCHELASTIC_RUN_ID, else one "
        "made at launch)",
        _run_id,
    ),
    "run_started": Setting(
        RUN_STARTED_VARIABLE,
        "--run-started",
        "when the run began, in Unix seconds (default: the time a made run id carries; give it where a run outlives "
        "its processes under one id, a pod's spec, so that a restarted process's metrics say what they cannot see)",
        _unix_time,
    ),
    "linger": Setting(
        "NPU_SHADOW_LINGER",
        "--linger",
        "the seconds >= 0 the metrics endpoint stays up after the job ends, until a scrape has read the final "
        f"counts (default {DEFAULT_LINGER_SECONDS:g}; with a Pushgateway or textfile, which hold the final counts "
        "too, only where something scraped the endpoint during the job)",
        _seconds,
    ),
    "emulate_npu": Setting(
        "NPU_SHADOW_EMULATE_NPU",
        "--emulate-npu",
        "a number of emulated npu devices, 1..16 (0 or empty: none)",
        _device_count,
    ),
    "emulated_soc": Setting(
        "NPU_SHADOW_EMULATED_SOC",
        "--emulated-soc",
        "the Ascend SoC the emulated npu reports to torch_npu's code (letters, digits, '_' and '-'; default "
        "Ascend910B1)",
        _soc,
    ),
    "emulated_device": Setting(
        "NPU_SHADOW_EMULATED_DEVICE",
        "--emulated-device",
        "the properties of a real device the emulated npu takes, comma-separated: capacity=SIZE (per device, "
        "B/KiB/MiB/GiB), kernel_time=TIME (each kernel's device time on an asynchronous queue, s/ms/us), "
        "nondeterministic=RELATIVE (convolutions' and backward reductions' run-to-run variation); default none",
        _device_properties,
    ),
    "legacy_from": Setting(
        "NPU_SHADOW_LEGACY_FROM",
        "--legacy-from",
        "a torch_npu wheel file, a version whose wheel is cached (2.14.0), a directory holding the torch_npu "
        "package, 'installed', or 'reference' "
        "(shadow.npu.reference: a rehearsal where no torch_npu is at hand)",
        _legacy_source,
    ),
    "shadow_patches": Setting(
        "NPU_SHADOW_SHADOW_PATCHES",
        "--shadow-patch",
        "a comma list of function patches of the --legacy-from release by dotted name (npu-shadow census RELEASE "
        "lists them: torch.nn.functional.layer_norm), each shadowed by a generic target (legacy from the release's "
        "source, upstream torch's); one the census says cannot run twice is refused",
        _dotted_names,
    ),
    "budget": Setting(
        "NPU_SHADOW_BUDGET",
        "--budget",
        "'off', or the fraction in (0, 1] of the job's wall time the shadow side of all the targets together may use "
        "(default 0.2)",
        _off_or_rate("(0"),
    ),
    "deadline": Setting(
        "NPU_SHADOW_DEADLINE",
        "--deadline",
        "'off', or the seconds > 0 the shadow side of one sampled call may take before the job goes on without it "
        "and the target stops shadowing (default 60)",
        _off_or_seconds,
    ),
    "pure_hooks": Setting(
        "NPU_SHADOW_PURE_HOOKS",
        "--pure-hooks",
        "1/true/yes or 0/false/no: the job's forward and backward hooks have no side effects, so calls that run "
        "them are compared (they run again on the shadow side) instead of skipped with reason hooks",
        _flag,
    ),
    "trusted_checkpoints": Setting(
        "NPU_SHADOW_TRUSTED_CHECKPOINTS",
        "--trusted-checkpoints",
        "1/true/yes or 0/false/no: the job's checkpoints are safe to unpickle twice, so torch_load compares loads "
        "whose pickle names the job's own classes (a whole model, an args Namespace) or with a callable "
        "map_location, instead of skipping them as ineligible (default: no)",
        _flag,
    ),
    "first_per_signature": Setting(
        "NPU_SHADOW_FIRST_PER_SIGNATURE",
        "--first-per-signature",
        "an integer >= 0: the first calls of every call signature compared whatever the sample rate (coverage "
        "guidance; default 30; 0: uniform sampling)",
        _non_negative,
    ),
    "aa_rate": Setting(
        "NPU_SHADOW_AA_RATE",
        "--aa-rate",
        "a fraction in [0, 1] of sampled calls on which legacy also runs against itself (the A/A noise floor; "
        "default 0.05; 0: none)",
        lambda text: _rate(text, "[0"),
    ),
    "backward_rate": Setting(
        "NPU_SHADOW_BACKWARD_RATE",
        "--backward-rate",
        "a fraction in [0, 1] of sampled DataParallel calls whose gradients are compared too, through upstream's graph "
        "and a graph of legacy's own (reason grad; default 0.05; 0: none)",
        lambda text: _rate(text, "[0"),
    ),
    "backward_memory": Setting(
        "NPU_SHADOW_BACKWARD_MEMORY",
        "--backward-memory",
        "a share in [0, 1] of the job's own device memory that a backward comparison's two graphs may take; one that "
        "would take more is not made (backward skip memory; default 0.3)",
        lambda text: _rate(text, "[0"),
    ),
    "truth_rate": Setting(
        "NPU_SHADOW_TRUTH_RATE",
        "--truth-rate",
        "a fraction in [0, 1] of calls whose sides differ in value that run again in float64 on the CPU, to tell "
        "which side is nearer the truth (default 0.25; 0: none)",
        lambda text: _rate(text, "[0"),
    ),
    "primary": Setting(
        "NPU_SHADOW_PRIMARY",
        "--primary",
        "legacy (shadowing: the caller gets legacy's result, upstream is compared) or upstream (a canary: the caller "
        "gets upstream's, legacy is compared; the rollback switch returns to legacy)",
        _choice("legacy", "upstream"),
    ),
    "rollback_file": Setting(
        "NPU_SHADOW_ROLLBACK_FILE",
        "--rollback-file",
        "a file path: when the file appears, the job returns legacy's result from the next call on",
        _nonempty,
    ),
    "rollback_port": Setting(
        "NPU_SHADOW_ROLLBACK_PORT",
        "--rollback-port",
        "a port number in 0..65535 for the rollback endpoint (LOCAL_RANK is added; needs NPU_SHADOW_ROLLBACK_TOKEN)",
        _port,
    ),
    "rollback_addr": Setting(
        "NPU_SHADOW_ROLLBACK_ADDR", "--rollback-addr", "an address to bind, e.g. 127.0.0.1", _matching(_ADDRESS)
    ),
    "rollback_token": Setting(
        "NPU_SHADOW_ROLLBACK_TOKEN",
        None,  # (never an option: a command line is visible to every user in ps)
        "the bearer token the rollback endpoint requires (at least 16 characters; the variable or a token file)",
        _token,
    ),
    "rollback_token_file": Setting(
        "NPU_SHADOW_ROLLBACK_TOKEN_FILE",
        "--rollback-token-file",
        "a file of yours that only you can read, holding the rollback endpoint's token",
        _token_file,
    ),
    "rollback_optional": Setting(
        "NPU_SHADOW_ROLLBACK_OPTIONAL",
        "--rollback-optional",
        "run a canary even where its rollback endpoint cannot start (default: refuse to start it)",
        _flag,
    ),
    "oracle": Setting(
        "NPU_SHADOW_ORACLE",
        "--oracle",
        "'off', or the fraction in [0, 1] of sampled DataParallel calls without autocast also checked against "
        "replica 0 alone on its device (calls under autocast always are; default 0.1)",
        _off_or_rate("[0"),
    ),
}


#: The settings given as bare launcher flags (``--otel``), with their help.
#: The settings of ``--gather``, for rehearsals and jobs run to gather evidence: every DataParallel call compared
#: (the targets whose calls are few and whose evidence is thinnest), the first calls of every signature compared as
#: by default, and the shadow side allowed half the job's wall time. A setting given explicitly overrides its value
#: here.
GATHER = {
    "sample_rate": {"parallel_apply": 1.0, "data_parallel": 1.0},
    "budget": 0.5,
}

FLAGS = {
    "gather": (
        "an evidence job: every DataParallel call compared (--sample-rate parallel_apply=1,data_parallel=1; other "
        "targets 0.01 and the first 30 calls of every signature), the shadow side allowed half the job's wall time "
        "(--budget 0.5); an option given too overrides its part"
    ),
    "otel": "export through OpenTelemetry",
    "rollback_optional": "run a canary even where its rollback endpoint cannot start",
    "pure_hooks": "the job's module hooks have no side effects: compare calls that run them",
    "trusted_checkpoints": "the job's checkpoints are safe to unpickle twice: compare loads that run their code",
    "journal_all": "a journal line for every comparison, matches too",
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
    journal_all: bool = False
    gather: bool = False
    capture_dir: str | None = None
    drill: tuple[str, float] | None = None
    pushgateway: str | None = None
    textfile: str | None = None
    run_id: str | None = None
    run_started: float | None = None
    linger: float | None = None  # (None: DEFAULT_LINGER_SECONDS where only the endpoint carries the final counts)
    emulate_npu: int = 0
    emulated_soc: str | None = None
    emulated_device: str | None = None
    legacy_from: str | None = None
    shadow_patches: tuple[str, ...] = ()
    oracle: float | None = 0.1
    budget: float | None = 0.2
    deadline: float | None = DEFAULT_DEADLINE
    pure_hooks: bool = False
    trusted_checkpoints: bool = False
    first_per_signature: int = DEFAULT_FIRST_PER_SIGNATURE
    aa_rate: float = 0.05
    backward_rate: float = 0.05
    backward_memory: float = 0.3
    truth_rate: float = 0.25
    primary: str = "legacy"
    rollback_file: str | None = None
    rollback_port: int | None = None
    rollback_addr: str = "127.0.0.1"
    rollback_token: str | None = None
    rollback_token_file: str | None = None
    rollback_optional: bool = False

    def monitor_settings(self, rolled_back: bool) -> Any:
        """The monitor's :class:`~shadow.core.calls.settings.Settings` from these, whole; ``rolled_back``: a switch
        thrown stays thrown when the monitor is installed anew (over new legacy patches, in a process started
        after it)."""
        from shadow.core.calls.sampled.drill import Drill
        from shadow.core.calls.settings import Settings

        return Settings(
            seed=self.seed,
            drill=Drill(*self.drill, seed=self.seed) if self.drill else None,
            oracle=self.oracle,
            budget=self.budget,
            deadline=self.deadline,
            pure_hooks=self.pure_hooks,
            trusted_checkpoints=self.trusted_checkpoints,
            first_per_signature=self.first_per_signature,
            aa_rate=self.aa_rate,
            backward_rate=self.backward_rate,
            backward_memory=self.backward_memory,
            truth_rate=self.truth_rate,
            primary="legacy" if rolled_back else self.primary,
        )


#: NPU_SHADOW_* variables that are not settings: set by the launcher for the job's processes, or read by the
#: scripts, the receiver and the emulated npu's build.
OTHER_VARIABLES = frozenset(
    {
        "NPU_SHADOW_CACHE_DIR", "NPU_SHADOW_COMMAND_ID", "NPU_SHADOW_DEMO_OUT", "NPU_SHADOW_DEMO_PORT",
        "NPU_SHADOW_ENABLED", "NPU_SHADOW_JOB", "NPU_SHADOW_MADE_RUN_ID", "NPU_SHADOW_PATCH_LIST",
        "NPU_SHADOW_METRICS_DIR", "NPU_SHADOW_METRICS_LAYOUT", "NPU_SHADOW_RECEIVER_TOKEN", "NPU_SHADOW_ROLLED_BACK_BY",
        "NPU_SHADOW_STARTED", "NPU_SHADOW_WHEEL_DIR",
    }
)  # fmt: skip


def misspelt_variables(environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """(variable, the setting's variable it is close to) for each NPU_SHADOW_* variable of ``environ`` that is no
    variable npu-shadow reads but looks like one (a typo would otherwise leave the job on defaults unsaid)."""
    import difflib

    known = {setting.variable for setting in SETTINGS.values()}
    found = []
    for name in sorted(environ):
        if name.startswith("NPU_SHADOW_") and name not in known and name not in OTHER_VARIABLES:
            # (a name that ends several settings' names is theirs, not the nearest one's: NPU_SHADOW_RATE)
            ending = sorted(v for v in known if v.endswith("_" + name.removeprefix("NPU_SHADOW_")))
            close = ending if len(ending) > 1 else difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.8)
            if close:
                found.append((name, close[0] if len(close) == 1 else "one of " + ", ".join(close)))
    return found


def from_sources(environ: Mapping[str, str], options: Mapping[str, str | None] | None = None) -> Config:
    """Settings from the environment, each overridden by its option when given. Raises ConfigError (a misspelt
    variable too: ``NPU_SHADOW_SAMPEL_RATE`` is refused, naming ``NPU_SHADOW_SAMPLE_RATE``)."""
    for name, meant in misspelt_variables(environ):
        raise ConfigError(f"{name} is not a setting of npu-shadow; did you mean {meant}?")
    values: dict[str, object] = {}
    for name, setting in SETTINGS.items():
        option_value = (options or {}).get(name)
        if option_value is not None:
            values[name] = setting.read(option_value, by_option=True)
        elif setting.variable in environ:
            values[name] = setting.read(environ[setting.variable], by_option=False)
    local_rank = environ.get("LOCAL_RANK", "")
    if "port" in values and local_rank.isascii() and local_rank.isdigit() and values["port"] + int(local_rank) > 65535:
        port = SETTINGS["port"]
        raise ConfigError(
            f"{port.option}={values['port']} ({port.variable}) plus LOCAL_RANK={local_rank} is past port 65535"
        )
    if "rollback_token_file" in values and "rollback_token" not in values:
        try:
            values["rollback_token"] = read_token_file(str(values["rollback_token_file"]))
        except Invalid as exc:
            raise ConfigError(f"{SETTINGS['rollback_token_file'].variable}: {exc.why}") from None
    if "rollback_port" in values and "rollback_token" not in values:
        port, token = SETTINGS["rollback_port"], SETTINGS["rollback_token"]
        raise ConfigError(f"{port.option} ({port.variable}) needs {token.variable}: no endpoint runs without one")
    if "shadow_patches" in values and values.get("legacy_from") in (None, REFERENCE):
        patches, legacy = SETTINGS["shadow_patches"], SETTINGS["legacy_from"]
        raise ConfigError(f"{patches.option} ({patches.variable}) needs {legacy.option} RELEASE: the patches' source")
    if ("rtol" in values) != ("atol" in values):
        given = "rtol" if "rtol" in values else "atol"
        missing = SETTINGS["atol" if given == "rtol" else "rtol"]
        raise ConfigError(f"{SETTINGS[given].option} needs {missing.option} ({missing.variable}) too")
    if values.get("gather"):
        values = {**GATHER, **values}
    return Config(**values)  # type: ignore[arg-type]


def linger_seconds(config: Config) -> float:
    """How long the endpoint stays up after the job: ``--linger``, else the default where nothing else carries
    the final counts (a Pushgateway or a textfile does)."""
    if config.port is None:
        return 0.0
    if config.linger is not None:
        return config.linger
    return 0.0 if config.pushgateway or config.textfile else DEFAULT_LINGER_SECONDS


def to_environ(options: Mapping[str, str | None]) -> dict[str, str]:
    """The variables that carry the given options to the job's processes."""
    return {SETTINGS[name].variable: value for name, value in options.items() if value is not None}
