"""The run a piece of evidence belongs to: its id, named, inherited or made (no torch here: the launcher and the
receiver read it before torch could load)."""

from __future__ import annotations

import calendar
import hashlib
import os
import re
import secrets
import time
from collections.abc import Mapping, MutableMapping

#: The run a person names (``npu-shadow run --run-id``): every series, journal line and capture carries it.
RUN_ID_VARIABLE = "NPU_SHADOW_RUN_ID"
#: The id a launcher (or the first process of a library-form job) made, for the processes of the job that have
#: neither a named run nor torchrun's.
MADE_RUN_ID_VARIABLE = "NPU_SHADOW_MADE_RUN_ID"
#: torchrun's id of a job, the same in every rank on every node ("none" where torchrun was given none).
TORCHRUN_RUN_ID_VARIABLE = "TORCHELASTIC_RUN_ID"
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")


def run_id_problem(text: str) -> str | None:
    """Why ``text`` cannot name a run (a label value: 1-64 letters, digits and ``._:-``), or None."""
    if _RUN_ID.fullmatch(text):
        return None
    return "1 to 64 letters, digits, '.', '_', ':' or '-', starting with a letter or digit"


def _from_torchrun(torchrun: str) -> str:
    """A run id for a torchrun id that cannot be one as it is (``team/job-1``, a space, 100 characters): what it has
    of a run id's characters, and eight hex digits of a hash of the whole, so that distinct ids stay distinct (and
    every rank, reading the same id, makes the same one)."""
    digest = hashlib.sha256(torchrun.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    cleaned = re.sub(r"[^A-Za-z0-9._:-]", "_", torchrun)[:55]
    return f"{cleaned if cleaned[:1].isalnum() else 'x' + cleaned[:54]}-{digest}"


def new_run_id() -> str:
    """A fresh run id: the UTC time and six random hex digits (``20261203T073500Z-1a2b3c``)."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3)


def run_id(environ: MutableMapping[str, str] = os.environ) -> str:
    """This process's run: the one named (:data:`RUN_ID_VARIABLE`), else torchrun's, else the one the launcher
    made, else one made now and put in ``environ`` (so the processes this one starts share it). Raises ValueError
    naming the variable when the named one cannot be a run id."""
    named = environ.get(RUN_ID_VARIABLE)
    if named is not None:
        problem = run_id_problem(named)
        if problem:
            raise ValueError(f"{RUN_ID_VARIABLE}={named!r} is not valid; expected {problem}")
        return named
    torchrun = environ.get(TORCHRUN_RUN_ID_VARIABLE, "")
    if torchrun and torchrun != "none":
        return torchrun if _RUN_ID.fullmatch(torchrun) else _from_torchrun(torchrun)
    made = environ.get(MADE_RUN_ID_VARIABLE, "")
    if run_id_problem(made):
        made = environ[MADE_RUN_ID_VARIABLE] = new_run_id()
    return made


#: When the run began (Unix seconds; ``npu-shadow run --run-started``): where a run outlives its processes (a pod
#: restarted under a run id its spec names), the time the first of them began, so that one moment of a later one's
#: metrics can say what it cannot see.
RUN_STARTED_VARIABLE = "NPU_SHADOW_RUN_STARTED"
#: When the processes of this launch began: the launcher's start (or a library-form job's first exporter), set once
#: and inherited by every process it starts.
STARTED_VARIABLE = "NPU_SHADOW_STARTED"
_MADE = re.compile(r"(\d{8}T\d{6}Z)-[0-9a-f]{6}")


def unix_time_problem(text: str) -> str | None:
    """Why ``text`` cannot be a time a run began (Unix seconds, finite, after 2000 and not in the future), or
    None."""
    try:
        value = float(text)
    except ValueError:
        return "Unix seconds, e.g. 1796600000"
    if not 946_684_800 <= value <= time.time() + 86_400:
        return "Unix seconds after 2000 and not in the future"
    return None


def run_started(run: str, environ: Mapping[str, str] = os.environ) -> float | None:
    """When the run ``run`` began, where this process can know: :data:`RUN_STARTED_VARIABLE`, else the time a made
    run id carries (:func:`new_run_id`); None for a named run or torchrun's (a restarted process cannot tell)."""
    text = environ.get(RUN_STARTED_VARIABLE, "").strip()
    if text and unix_time_problem(text) is None:
        return float(text)
    made = _MADE.fullmatch(run)
    if made:
        return float(calendar.timegm(time.strptime(made.group(1), "%Y%m%dT%H%M%SZ")))
    return None


def started(environ: MutableMapping[str, str] = os.environ) -> float:
    """When the processes of this launch began (:data:`STARTED_VARIABLE`), set to now where no one set it yet (so
    that the processes this one starts share it)."""
    text = environ.get(STARTED_VARIABLE, "").strip()
    if text and unix_time_problem(text) is None:
        return float(text)
    now = time.time()
    environ[STARTED_VARIABLE] = repr(now)
    return now


#: The variables that carry a job's restart count: torchrun's (elastic restarts), Slurm's (a requeued job).
RESTART_VARIABLES = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")
#: A command line's arguments that differ between the ranks of one job (torch.distributed.launch's, DeepSpeed's).
_PER_RANK_ARGUMENT = re.compile(r"--local[-_]rank(=\S*)?")


#: The job's command id a launcher gives every process it starts (``npu-shadow run``: of the command it wraps;
#: ``npu-shadow ab``: of the A/B, whose two worlds are one job).
COMMAND_ID_VARIABLE = "NPU_SHADOW_COMMAND_ID"


def command_id(argv: list[str] | None = None, environ: Mapping[str, str] = os.environ) -> str:
    """Which job this process runs: the id a launcher gave it (:data:`COMMAND_ID_VARIABLE`), else twelve hex digits
    of a hash of its command line (``sys.argv``, less the arguments that differ between ranks). Every rank and
    spawned worker of one job has the same; two jobs given one run id by mistake have two, and the verdict refuses
    to pool them."""
    import sys

    given = environ.get(COMMAND_ID_VARIABLE, "") if argv is None else ""
    if given and not run_id_problem(given):
        return given
    words = list(sys.argv if argv is None else argv)
    kept: list[str] = []
    skip = False
    for word in words:
        if skip:
            skip = False
            continue
        match = _PER_RANK_ARGUMENT.fullmatch(word)
        if match:
            skip = match.group(1) is None  # (``--local_rank 3``: its value is the next word)
            continue
        kept.append(word)
    return hashlib.sha256("\0".join(kept).encode("utf-8", "surrogatepass")).hexdigest()[:12]


def restarts(environ: MutableMapping[str, str] = os.environ) -> int:
    """How many times the launcher restarted this job (:data:`RESTART_VARIABLES`; 0 where none says, or where the
    value is not a count)."""
    for variable in RESTART_VARIABLES:
        text = environ.get(variable, "").strip()
        if text.isascii() and text.isdigit():
            return int(text)
    return 0
