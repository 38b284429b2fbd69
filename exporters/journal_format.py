"""The journal's schema, shared by its writer (:class:`exporters.journal.JsonlExporter`) and its readers
(:mod:`shadow.analysis.sources`, :mod:`shadow.analysis.report`): the records it holds, each one JSON object a line.

- An observation's line: ``time`` and ``timestamp`` first, then every field of :class:`Observation` that is data
  (:data:`OBSERVATION_FIELDS`, in the dataclass's order: a field added there is journalled), ``capture``, the
  caller's annotations, and the process's fields last (:data:`PROCESS_FIELDS`). Fields are named by role
  (``primary_seconds``, ``shadow_seconds``); a line written before carries ``legacy_seconds`` and
  ``upstream_seconds``, which :func:`readable` turns into the role's names.
- Event records (``"event"``: :data:`EVENTS`): the journal's header, count records (:data:`COUNT_TABLES`), rollbacks,
  resets and a canary A/B's iterators.

The line is framed by a function made once from the schema (strings through json's own C escaper): several times
faster than encoding a dict, and the journal writes on the training thread.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import re
from collections.abc import Callable, Iterator
from json.encoder import encode_basestring_ascii

from shadow.core.model import contract
from shadow.core.model.observation import DIFFERS_IN_FLOAT64, LEGACY, Observation, error_decade

#: How every observation's line starts: readers locate outcome lines by it without parsing them.
LINE_START = b'{"time":'

#: The process's fields, last on every line, in this order (readers locate a line's process from its end).
PROCESS_FIELDS = ("run", "host", "pid", "stream", "rank", "torch", "torch_npu", "device")
#: The process fields as a line ends with them: host, pid and stream (the process's own key).
PROCESS_KEY = re.compile(rb',"host":("(?:[^"\\]|\\.)*"|null),"pid":(\d+),"stream":"([0-9a-f]*)"')

#: The records that are not observations, by their ``event``.
EVENTS = ("journal", "counts", "rollback", "reset", "arm", "patch_calls")


#: Observation fields never journalled: the evidence (a capture's), what a held difference waits with, and the
#: timestamp (written first, beside its ISO time).
_NOT_JOURNALLED = {"evidence", "leaf_errors", "noise_pending", "timestamp"}
#: Text fields written as null where empty (what a reader tests for).
NULL_WHEN_EMPTY = {
    "shared_divergence", "backward_skip", "nearer", "noise_check", "aa_check", "grad_noise_check", "grad_aa_check",
}  # fmt: skip

#: The observation's fields on its line, in order, with their types.
OBSERVATION_FIELDS: tuple[tuple[str, str], ...] = tuple(
    (f.name, str(f.type)) for f in dataclasses.fields(Observation) if f.name not in _NOT_JOURNALLED
)

#: Names a line had before they were named by role: new name -> (the name where legacy was the primary, where
#: upstream was).
RENAMED = {
    "primary_seconds": ("legacy_seconds", "upstream_seconds"),
    "shadow_seconds": ("upstream_seconds", "legacy_seconds"),
}

_UTC = datetime.timezone.utc
quote = encode_basestring_ascii


def number(value: float) -> str:
    """A JSON number, or a string for inf/nan (strict JSON has neither)."""
    return repr(float(value)) if math.isfinite(value) else f'"{value}"'


def _iso(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp, _UTC).isoformat()


def _encoded(name: str, kind: str) -> str:
    """The f-string part that writes field ``name`` of ``o`` (its type ``kind``)."""
    value = f"o.{name}"
    if kind == "str":
        text = f"_quote({value})"
        return f'{{{text} if {value} else "null"}}' if name in NULL_WHEN_EMPTY else f"{{{text}}}"
    if kind == "float":
        return f"{{_number({value})}}"
    if kind == "int":
        return f"{{{value}:d}}"
    if kind == "bool":
        return f'{{"true" if {value} else "false"}}'
    if kind == "tuple[str, ...]":
        return f'[{{",".join(map(_quote, {value}))}}]'
    raise TypeError(f"the journal cannot write Observation.{name} of type {kind}")


def _line_function() -> Callable[[Observation, str, str], str]:
    """``line(o, capture, tail)``: an observation's line, from :data:`OBSERVATION_FIELDS` (``capture``: the JSON
    of its capture's path; ``tail``: the members after it, annotations and process fields, with the newline)."""
    members = ",".join(f'"{name}":{_encoded(name, kind)}' for name, kind in OBSERVATION_FIELDS)
    source = (
        "def line(o, capture, tail):\n"
        f'    return f\'{{{{"time":{{_quote(_iso(o.timestamp))}},"timestamp":{{o.timestamp!r}},{members},'
        '"capture":{capture},{tail}\'\n'
    )
    scope = {"_quote": quote, "_number": number, "_iso": _iso}
    exec(compile(source, "<journal line>", "exec"), scope)  # (our own schema's text: no outside input)
    return scope["line"]


#: An observation's line (:func:`_line_function`).
observation_line = _line_function()


def readable(record: dict) -> dict:
    """An observation's record with the fields of today's schema: a line written before the role names gets them
    from the old ones (by the side that was primary)."""
    if "primary_seconds" in record or "legacy_seconds" not in record:
        return record
    was = 0 if record.get("primary", LEGACY) == LEGACY else 1
    return {**record, **{new: record.get(old[was], 0.0) for new, old in RENAMED.items()}}


#: The count record's names of the verdict's series named before the series were (kept: journals written then are
#: read); a series added since is named by its metric (``npu_shadow.backward_skips``: ``backward_skips``).
_NAMED_BEFORE = {
    contract.COMPARISONS: "outcomes",
    contract.MISMATCHES: "reasons",
    contract.SHARED_DIVERGENCES: "shared",
    contract.TRUTH_RUNS: "truth",
    contract.BACKWARD_RUNS: "backward",
    contract.NOISE_CHECKS: "noise",
}


def _table(metric: contract.Metric) -> str:
    return _NAMED_BEFORE.get(metric) or metric.otel_name.rpartition(".")[2]


#: The count record's tables, each one series of the contract summed by the labels it keeps (an outer key, and an
#: inner key of the others joined by "/": ``{"forward": {"ab/beyond": count}}``): every series the verdict reads
#: (:data:`shadow.core.model.contract.EVIDENCE`) that is kept by a label, and the fire drill's marks.
TABLE_SERIES: dict[str, tuple[contract.Metric, tuple[str, ...]]] = {
    **{_table(metric): (metric, keys) for metric, keys in contract.EVIDENCE.items() if keys},
    "drilled_outcomes": (contract.DRILLED, ("signature", "outcome")),
    "drilled_reasons": (contract.DRILLED_REASONS, ("reason",)),
}
#: The count record's plain counts, each one series of the contract summed whole: the verdict's series kept by no
#: label, and the drill's comparisons.
SCALAR_SERIES = {
    **{_table(metric): metric for metric, keys in contract.EVIDENCE.items() if not keys},
    "drilled": contract.DRILLED,
}
#: The count record's tables and plain counts that are evidence (what the readers add up; the drill's marks are set
#: aside by them).
EVIDENCE_TABLES = tuple(name for name, (metric, _) in TABLE_SERIES.items() if metric in contract.EVIDENCE)
EVIDENCE_SCALARS = tuple(name for name, metric in SCALAR_SERIES.items() if metric in contract.EVIDENCE)
#: A count record's tables: name -> depth (2: {outer: {inner: count}}, 1: {key: count}): those of the series, and
#: the truth runs' decades (the journal's own: of the observations' truth errors).
COUNT_TABLES = {**{name: min(len(keys), 2) for name, (_, keys) in TABLE_SERIES.items()}, "truth_decades": 2}
#: A count record's plain counts.
COUNT_SCALARS = tuple(SCALAR_SERIES)
#: The series a phase's counts hold: where their target and primary labels are, and the tables and plain counts each
#: is summed into (with where the table's keys are among its labels; None: a plain count).
PHASE_SERIES: dict[contract.Metric, tuple[int, int]] = {}
_INTO: dict[contract.Metric, list[tuple[str, tuple[int, ...] | None]]] = {}
for _name, (_metric, _keys) in TABLE_SERIES.items():
    _INTO.setdefault(_metric, []).append((_name, tuple(_metric.labels.index(key) for key in _keys)))
for _name, _metric in SCALAR_SERIES.items():
    _INTO.setdefault(_metric, []).append((_name, None))
for _metric in _INTO:
    PHASE_SERIES[_metric] = (_metric.labels.index("target"), _metric.labels.index("primary"))


class Counts:
    """What one (target, primary) phase of a process counted since the exporter started: the contract's samples of
    :data:`PHASE_SERIES`, each summed into its table (:data:`TABLE_SERIES`) or plain count (:data:`SCALAR_SERIES`),
    and the decades of its truth runs (a table only the journal keeps: of the observations' truth errors). Written
    whole (cumulative) in count records (:data:`COUNT_TABLES`)."""

    __slots__ = (*COUNT_TABLES, *COUNT_SCALARS)

    def __init__(self) -> None:
        for name in COUNT_TABLES:
            setattr(self, name, {})
        for name in COUNT_SCALARS:
            setattr(self, name, 0)

    def add(self, metric: contract.Metric, labels: tuple[str, ...], value: float) -> None:
        """Add one sample of a series of :data:`PHASE_SERIES` (``labels`` in the metric's order)."""
        for name, keys in _INTO[metric]:
            if keys is None:
                setattr(self, name, getattr(self, name) + value)
            elif len(keys) == 1:
                table, key = getattr(self, name), labels[keys[0]]
                table[key] = table.get(key, 0) + value
            else:
                _bump(getattr(self, name), labels[keys[0]], "/".join(labels[key] for key in keys[1:]), value)

    def truth_decade(self, o: Observation) -> None:
        """The decade of a truth run's errors (their ratio's), where it has one."""
        decade = error_decade(o.legacy_truth_error, o.upstream_truth_error) if o.nearer else None
        if decade is not None and o.nearer != DIFFERS_IN_FLOAT64:  # (errors against two runs: no ratio)
            _bump(self.truth_decades, o.signature, str(decade))

    def fields(self) -> dict:
        """The count record's fields."""
        return {name: getattr(self, name) for name in (*COUNT_TABLES, *COUNT_SCALARS)}


def record_samples(fields: dict) -> Iterator[tuple[contract.Metric, dict[str, str], float]]:
    """A count record's evidence (:data:`EVIDENCE_TABLES` and :data:`EVIDENCE_SCALARS`) as the samples of the
    series it sums (each sample's labels less target and primary, the record's own): the inverse of
    :meth:`Counts.add`, so that one reader turns every source's series into the verdict's counts."""
    for name in EVIDENCE_TABLES:
        metric, keys = TABLE_SERIES[name]
        table = fields.get(name, {})
        values = (v for inner in table.values() for v in (inner.values() if len(keys) > 1 else [inner]))
        for labels, value in zip(table_labels(table, keys), values, strict=True):
            yield metric, labels, value
    for name in EVIDENCE_SCALARS:
        if name in fields:
            yield SCALAR_SERIES[name], {}, fields[name]


def table_labels(table: dict, keys: tuple[str, ...]) -> Iterator[dict[str, str]]:
    """The labels of each count of a count record's ``table`` (of a series kept by ``keys``: :data:`TABLE_SERIES`);
    an inner key of too few parts lacks the labels it does not give."""
    for outer, inner in table.items():
        if len(keys) == 1:
            yield {keys[0]: outer}
            continue
        for key in inner:
            yield dict(zip(keys, (outer, *key.split("/", len(keys) - 2)), strict=False))


def _bump(table: dict[str, dict[str, float]], signature: str, key: str, count: float = 1) -> None:
    by_key = table.setdefault(signature, {})
    by_key[key] = by_key.get(key, 0) + count
