"""Settings from environment variables (and the launcher's options, which set the same variables).

Every value is checked when it is read, so a wrong setting fails at start-up with a message that names
the variable (or the option) and what it accepts, never halfway through training.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from shadow.core.calls.gate.budget import DEFAULT_DEADLINE
from shadow.core.model.observation import DEFAULT_FIRST_PER_SIGNATURE, DRILL_KINDS
from shadow.core.model.run_ids import RUN_ID_VARIABLE, RUN_STARTED_VARIABLE
from shadow.launcher import setting_values

#: How long the launcher keeps the metrics endpoint up after the job, by default: one scrape at Prometheus'
#: default interval (1 min), with margin for a late one.
DEFAULT_LINGER_SECONDS = 75.0


class ConfigError(ValueError):
    """A setting has a value it cannot have; the message names the setting."""


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
        except setting_values.Invalid as exc:
            which = self.option if by_option else self.variable
            why = f": {exc.why}" if exc.why else ""
            raise ConfigError(f"{which}={text!r} is not valid{why}; expected {self.accepts}") from None


SETTINGS = {
    "targets": Setting(
        "NPU_SHADOW_TARGETS",
        "--targets",
        f"a comma list of {', '.join(sorted(setting_values.BUILTINS))}",
        setting_values.targets,
    ),
    "sample_rate": Setting(
        "NPU_SHADOW_SAMPLE_RATE",
        "--sample-rate",
        "a number in [0, 1], or target=rate pairs separated by commas",
        setting_values.sample_rate,
    ),
    "seed": Setting("NPU_SHADOW_SEED", "--seed", "an integer", setting_values.integer),
    "rtol": Setting(
        "NPU_SHADOW_RTOL", "--rtol", "a finite number >= 0 (set together with atol)", setting_values.tolerance
    ),
    "atol": Setting(
        "NPU_SHADOW_ATOL", "--atol", "a finite number >= 0 (set together with rtol)", setting_values.tolerance
    ),
    "port": Setting(
        "NPU_SHADOW_PROMETHEUS_PORT", "--port", "a port number in 0..65535 (LOCAL_RANK is added)", setting_values.port
    ),
    "addr": Setting(
        "NPU_SHADOW_PROMETHEUS_ADDR",
        "--addr",
        "an address to bind, e.g. 127.0.0.1",
        setting_values.matching(setting_values.ADDRESS),
    ),
    "multiproc_dir": Setting(
        "NPU_SHADOW_MULTIPROC_DIR",
        "--multiproc-dir",
        "a directory of yours that no one else can write (each job gets a fresh folder inside it)",
        setting_values.private_directory,
    ),
    "otel": Setting("NPU_SHADOW_OTEL", "--otel", "1/true/yes or 0/false/no", setting_values.flag),
    "journal": Setting(
        "NPU_SHADOW_JOURNAL", "--journal", "a file path ({rank} and {pid} allowed)", setting_values.file_template
    ),
    "gather": Setting(
        "NPU_SHADOW_GATHER",
        "--gather",
        "1/true/yes or 0/false/no: an evidence job (the --gather preset: docs/launcher.md)",
        setting_values.flag,
    ),
    "journal_all": Setting(
        "NPU_SHADOW_JOURNAL_ALL",
        "--journal-all",
        "1/true/yes or 0/false/no: the journal has a line for every comparison, matches too (by default matches "
        "are only counted, in its count records)",
        setting_values.flag,
    ),
    "capture_dir": Setting(
        "NPU_SHADOW_CAPTURE_DIR",
        "--capture-dir",
        "a directory path of yours that no one else can write",
        setting_values.private_directory,
    ),
    "drill": Setting(
        "NPU_SHADOW_DRILL",
        "--drill",
        f"KIND:RATE with KIND one of {', '.join(DRILL_KINDS)}, RATE in [0, 1]",
        setting_values.drill,
    ),
    "pushgateway": Setting(
        "NPU_SHADOW_PUSHGATEWAY",
        "--pushgateway",
        "a Pushgateway address, e.g. 127.0.0.1:9091",
        setting_values.matching(setting_values.GATEWAY),
    ),
    "textfile": Setting(
        "NPU_SHADOW_TEXTFILE",
        "--textfile",
        "a file path for the exposition written at exit ({rank} and {pid} allowed)",
        setting_values.file_template,
    ),
    "run_id": Setting(
        RUN_ID_VARIABLE,
        "--run-id",
        "a run id: 1 to 64 letters, digits, '.', '_', ':' or '-' (default: torchrun's TORCHELASTIC_RUN_ID, else one "
        "made at launch)",
        setting_values.run_id,
    ),
    "run_started": Setting(
        RUN_STARTED_VARIABLE,
        "--run-started",
        "when the run began, in Unix seconds (default: the time a made run id carries; give it where a run outlives "
        "its processes under one id, a pod's spec, so that a restarted process's metrics say what they cannot see)",
        setting_values.unix_time,
    ),
    "linger": Setting(
        "NPU_SHADOW_LINGER",
        "--linger",
        "the seconds >= 0 the metrics endpoint stays up after the job ends, until a scrape has read the final "
        f"counts (default {DEFAULT_LINGER_SECONDS:g}; with a Pushgateway or textfile, which hold the final counts "
        "too, only where something scraped the endpoint during the job)",
        setting_values.seconds,
    ),
    "emulate_npu": Setting(
        "NPU_SHADOW_EMULATE_NPU",
        "--emulate-npu",
        "a number of emulated npu devices, 1..16 (0 or empty: none)",
        setting_values.device_count,
    ),
    "emulated_soc": Setting(
        "NPU_SHADOW_EMULATED_SOC",
        "--emulated-soc",
        "the Ascend SoC the emulated npu reports to torch_npu's code (letters, digits, '_' and '-'; default "
        "Ascend910B1)",
        setting_values.soc,
    ),
    "emulated_device": Setting(
        "NPU_SHADOW_EMULATED_DEVICE",
        "--emulated-device",
        "the properties of a real device the emulated npu takes, comma-separated: capacity=SIZE (per device, "
        "B/KiB/MiB/GiB), kernel_time=TIME (each kernel's device time on an asynchronous queue, s/ms/us), "
        "nondeterministic=RELATIVE (convolutions' and backward reductions' run-to-run variation); default none",
        setting_values.device_properties,
    ),
    "legacy_from": Setting(
        "NPU_SHADOW_LEGACY_FROM",
        "--legacy-from",
        "a torch_npu wheel file, a version whose wheel is cached (2.14.0), a directory holding the torch_npu "
        "package, 'installed', or 'reference' "
        "(shadow.npu.reference: a rehearsal where no torch_npu is at hand)",
        setting_values.legacy_source,
    ),
    "shadow_patches": Setting(
        "NPU_SHADOW_SHADOW_PATCHES",
        "--shadow-patch",
        "a comma list of function patches of the --legacy-from release by dotted name (npu-shadow census RELEASE "
        "lists them: torch.nn.functional.layer_norm), each shadowed by a generic target (legacy from the release's "
        "source, upstream torch's); one the census says cannot run twice is refused",
        setting_values.dotted_names,
    ),
    "budget": Setting(
        "NPU_SHADOW_BUDGET",
        "--budget",
        "'off', or the fraction in (0, 1] of the job's wall time the shadow side of all the targets together may use "
        "(default 0.2)",
        setting_values.off_or_rate("(0"),
    ),
    "deadline": Setting(
        "NPU_SHADOW_DEADLINE",
        "--deadline",
        "'off', or the seconds > 0 the shadow side of one sampled call may take before the job goes on without it "
        "and the target stops shadowing (default 60)",
        setting_values.off_or_seconds,
    ),
    "pure_hooks": Setting(
        "NPU_SHADOW_PURE_HOOKS",
        "--pure-hooks",
        "1/true/yes or 0/false/no: the job's forward and backward hooks have no side effects, so calls that run "
        "them are compared (they run again on the shadow side) instead of skipped with reason hooks",
        setting_values.flag,
    ),
    "trusted_checkpoints": Setting(
        "NPU_SHADOW_TRUSTED_CHECKPOINTS",
        "--trusted-checkpoints",
        "1/true/yes or 0/false/no: the job's checkpoints are safe to unpickle twice, so torch_load compares loads "
        "whose pickle names the job's own classes (a whole model, an args Namespace) or with a callable "
        "map_location, instead of skipping them as ineligible (default: no)",
        setting_values.flag,
    ),
    "first_per_signature": Setting(
        "NPU_SHADOW_FIRST_PER_SIGNATURE",
        "--first-per-signature",
        "an integer >= 0: the first calls of every call signature compared whatever the sample rate (coverage "
        "guidance; default 30; 0: uniform sampling)",
        setting_values.non_negative,
    ),
    "aa_rate": Setting(
        "NPU_SHADOW_AA_RATE",
        "--aa-rate",
        "a fraction in [0, 1] of sampled calls on which legacy also runs against itself (the A/A noise floor; "
        "default 0.05; 0: none)",
        lambda text: setting_values.rate(text, "[0"),
    ),
    "backward_rate": Setting(
        "NPU_SHADOW_BACKWARD_RATE",
        "--backward-rate",
        "a fraction in [0, 1] of sampled DataParallel calls whose gradients are compared too, through upstream's graph "
        "and a graph of legacy's own (reason grad; default 0.05; 0: none)",
        lambda text: setting_values.rate(text, "[0"),
    ),
    "backward_memory": Setting(
        "NPU_SHADOW_BACKWARD_MEMORY",
        "--backward-memory",
        "a share in [0, 1] of the job's own device memory that a backward comparison's two graphs may take; one that "
        "would take more is not made (backward skip memory; default 0.3)",
        lambda text: setting_values.rate(text, "[0"),
    ),
    "truth_rate": Setting(
        "NPU_SHADOW_TRUTH_RATE",
        "--truth-rate",
        "a fraction in [0, 1] of calls whose sides differ in value that run again in float64 on the CPU, to tell "
        "which side is nearer the truth (default 0.25; 0: none)",
        lambda text: setting_values.rate(text, "[0"),
    ),
    "primary": Setting(
        "NPU_SHADOW_PRIMARY",
        "--primary",
        "legacy (shadowing: the caller gets legacy's result, upstream is compared) or upstream (a canary: the caller "
        "gets upstream's, legacy is compared; the rollback switch returns to legacy)",
        setting_values.choice("legacy", "upstream"),
    ),
    "rollback_file": Setting(
        "NPU_SHADOW_ROLLBACK_FILE",
        "--rollback-file",
        "a file path: when the file appears, the job returns legacy's result from the next call on",
        setting_values.nonempty,
    ),
    "rollback_port": Setting(
        "NPU_SHADOW_ROLLBACK_PORT",
        "--rollback-port",
        "a port number in 0..65535 for the rollback endpoint (LOCAL_RANK is added; needs NPU_SHADOW_ROLLBACK_TOKEN)",
        setting_values.port,
    ),
    "rollback_addr": Setting(
        "NPU_SHADOW_ROLLBACK_ADDR",
        "--rollback-addr",
        "an address to bind, e.g. 127.0.0.1",
        setting_values.matching(setting_values.ADDRESS),
    ),
    "rollback_token": Setting(
        "NPU_SHADOW_ROLLBACK_TOKEN",
        None,  # (never an option: a command line is visible to every user in ps)
        "the bearer token the rollback endpoint requires (at least 16 characters; the variable or a token file)",
        setting_values.token,
    ),
    "rollback_token_file": Setting(
        "NPU_SHADOW_ROLLBACK_TOKEN_FILE",
        "--rollback-token-file",
        "a file of yours that only you can read, holding the rollback endpoint's token",
        setting_values.token_file,
    ),
    "rollback_optional": Setting(
        "NPU_SHADOW_ROLLBACK_OPTIONAL",
        "--rollback-optional",
        "run a canary even where its rollback endpoint cannot start (default: refuse to start it)",
        setting_values.flag,
    ),
    "oracle": Setting(
        "NPU_SHADOW_ORACLE",
        "--oracle",
        "'off', or the fraction in [0, 1] of sampled DataParallel calls without autocast also checked against "
        "replica 0 alone on its device (calls under autocast always are; default 0.1)",
        setting_values.off_or_rate("[0"),
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
            values["rollback_token"] = setting_values.read_token_file(str(values["rollback_token_file"]))
        except setting_values.Invalid as exc:
            raise ConfigError(f"{SETTINGS['rollback_token_file'].variable}: {exc.why}") from None
    if "rollback_port" in values and "rollback_token" not in values:
        port, token = SETTINGS["rollback_port"], SETTINGS["rollback_token"]
        raise ConfigError(f"{port.option} ({port.variable}) needs {token.variable}: no endpoint runs without one")
    if "shadow_patches" in values and values.get("legacy_from") in (None, setting_values.REFERENCE):
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
