"""The ``--npu-shadow`` session: legacy patched, monitor installed, every observation attributed to its test."""

from __future__ import annotations

import collections
import dataclasses
import importlib.metadata
import importlib.util
import os
from collections.abc import Iterator
from typing import Any

import pytest

from exporters import JsonlExporter
from shadow.core.calls.monitor import install
from shadow.core.model.observation import DIVERGENT_OUTCOMES, Observation, label_text
from shadow.core.support.rates import parse_rate
from shadow.npu import reference, torch_npu_source

DIVERGENT = DIVERGENT_OUTCOMES

#: The counts the summary shows, per target (an xdist worker sends them to the controller).
_COUNTS = ("calls", "compared", "match", "close", "mismatch", "noise", "error", "skipped")


#: At most this many divergences are taken from one xdist worker's evidence.
MAX_WORKER_DIVERGENCES = 10_000


def worker_evidence(raw: Any) -> tuple[dict[str, Any] | None, str]:
    """An xdist worker's evidence checked (it crosses a process boundary): ``({"stats", "divergences"}, "")`` when
    every target name is one a Target may have (no control characters), every count a whole number >= 0 of a known
    kind and every divergence three strings (their control characters made ``?``: they reach a terminal); else
    ``(None, why)``."""
    if (
        not isinstance(raw, dict)
        or not isinstance(raw.get("stats"), dict)
        or not isinstance(raw.get("divergences"), list)
    ):
        return None, "not a mapping with stats and divergences"
    stats: dict[str, dict[str, int]] = {}
    for name, counts in raw["stats"].items():
        if not isinstance(name, str) or not name or label_text(name, 200) != name:
            return None, f"{name!a:.40} is no target name"
        if not isinstance(counts, dict):
            return None, f"stats of {name!a:.40} are not a mapping"
        for kind, value in counts.items():
            if kind not in _COUNTS or isinstance(value, bool) or not isinstance(value, int) or value < 0:
                return None, f"{name:.40}: {kind!a:.20} = {value!a:.20} is not a count"
        stats[name] = {kind: counts.get(kind, 0) for kind in _COUNTS}
    divergences = raw["divergences"]
    if len(divergences) > MAX_WORKER_DIVERGENCES or not all(
        isinstance(d, (list, tuple)) and len(d) == 3 and all(isinstance(x, str) for x in d) for d in divergences
    ):
        return None, "divergences are not (test, phase, text) strings"
    return {"stats": stats, "divergences": [tuple(label_text(x, 400) for x in d) for d in divergences]}, ""


@dataclasses.dataclass(frozen=True)
class Divergence:
    """One divergent observation, and where in the run it happened."""

    test: str  # node id, or "" outside a test
    phase: str  # setup, call, teardown, or collection/between tests
    observation: Observation

    def describe(self) -> str:
        o = self.observation
        reasons = f" ({', '.join(o.reasons)})" if o.reasons else ""
        return f"{o.target} {o.outcome}{reasons} [{o.signature}]: {label_text(o.detail, 300)}"


def _rate(config: pytest.Config, name: str) -> float:
    """``--npu-shadow-<name>`` (``backward_rate``: ``--npu-shadow-backward-rate``), else the launcher's variable
    ``NPU_SHADOW_<NAME>``, else 0; refused at start-up, naming the option or variable, where it is no rate."""
    option = "--npu-shadow-" + name.replace("_", "-")
    text, setting = config.getoption("npu_shadow_" + name), option
    if text is None:
        variable = "NPU_SHADOW_" + name.upper()
        text, setting = os.environ.get(variable), variable
    if text is None or text == "":
        return 0.0
    try:
        return parse_rate(text, setting)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


class ShadowSession:
    """A pytest plugin object: registered by :func:`shadow_pytest.pytest_configure` when enabled."""

    def __init__(self, config: pytest.Config) -> None:
        option = config.getoption
        self.strict = option("npu_shadow_strict")
        self.where: tuple[str, str] = ("", "collection")
        self.divergences: dict[tuple[str, str], list[Divergence]] = collections.defaultdict(list)
        self.diverged_tests: dict[str, list[Divergence]] = {}
        self.workers: list[dict[str, Any]] = []  # under pytest-xdist: each worker's evidence (the controller)
        #: Workers whose evidence is not in the summary: (worker id, why), a crash or a refusal.
        self.workers_missing: list[tuple[str, str]] = []
        if option("npu_shadow_emulate_npu"):
            from shadow.npu import emulated

            try:
                emulated.install(option("npu_shadow_emulate_npu"))
            except (emulated.EmulatorUnavailable, ValueError) as exc:
                raise pytest.UsageError(f"--npu-shadow-emulate-npu: {exc}") from None
        self.legacy, self._patches = self._install_legacy(option("npu_shadow_legacy"), option("npu_shadow_legacy_from"))
        targets = option("npu_shadow_targets")
        names = [t.strip() for t in targets.split(",") if t.strip()] if targets else None
        self.journal_path = option("npu_shadow_journal")
        self.journal = JsonlExporter(self.journal_path, all_outcomes=True, annotate=self._annotation)
        rates = {name: _rate(config, name) for name in ("backward_rate", "truth_rate")}
        try:
            self.monitor = install(
                names,
                sample_rate=1.0,
                exporters=[self, self.journal],
                seed=0,
                yields=True,
                pure_hooks=option("npu_shadow_pure_hooks"),
                trusted_checkpoints=option("npu_shadow_trusted_checkpoints"),
                **rates,
            )
        except ValueError as exc:
            self._undo_legacy()
            raise pytest.UsageError(f"--npu-shadow: {exc}") from None

    # ------------------------------------------------------------------ legacy

    @staticmethod
    def _install_legacy(choice: str, source: str | None) -> tuple[str, Any]:
        if source:
            try:
                loaded = torch_npu_source.load(source)
            except (torch_npu_source.LegacySourceError, OSError) as exc:
                raise pytest.UsageError(f"--npu-shadow-legacy-from: {exc}") from None
            return loaded.origin, loaded.patch_torch()
        installed = importlib.util.find_spec("torch_npu") is not None
        if choice == "torch_npu" or (choice == "auto" and installed):
            try:
                import torch_npu  # noqa: F401  (patches torch)
            except Exception as exc:
                raise pytest.UsageError(f"--npu-shadow-legacy torch_npu: cannot import torch_npu: {exc}") from None
            return f"torch_npu {importlib.metadata.version('torch_npu')} (imported)", None
        return "shadow.npu.reference (our reading of torch_npu 2.12: a rehearsal)", reference.patch_torch()

    def _undo_legacy(self) -> None:
        if self._patches is not None:
            self._patches.undo()
            self._patches = None

    def header(self) -> str:
        return f"npu-shadow: every call shadowed over {self.legacy}; journal {self.journal_path}"

    # ------------------------------------------------------------------ attribution (an exporter)

    def _annotation(self) -> dict[str, str]:
        test, phase = self.where
        return {"test": test, "phase": phase}

    def export(self, observation: Observation) -> None:
        if observation.outcome in DIVERGENT:
            test, phase = self.where
            found = Divergence(test, phase, observation)
            self.divergences[(test, phase)].append(found)
            if test:
                self.diverged_tests.setdefault(test, []).append(found)

    # ------------------------------------------------------------------ where we are

    def _during(self, item: pytest.Item, phase: str) -> Iterator[None]:
        self.where = (item.nodeid, phase)
        try:
            yield
        finally:
            self.monitor.deliver()  # (the phase's records, attributed to it: they reach the exporters now)
            self.where = ("", "between tests")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Iterator[None]:
        yield from self._during(item, "setup")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Iterator[None]:
        yield from self._during(item, "call")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Iterator[None]:
        yield from self._during(item, "teardown")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
        outcome = yield
        found = self.divergences.get((item.nodeid, call.when))
        if not (self.strict and found):
            return
        report = outcome.get_result()
        text = "npu-shadow: legacy and upstream diverged in this test:\n" + "\n".join(
            f"  {d.describe()}" for d in found
        )
        if report.passed:
            report.outcome = "failed"
            report.longrepr = text
        else:  # the test failed on its own: its failure stays, the divergence is added
            report.sections.append(("npu-shadow", text))

    # ------------------------------------------------------------------ pytest-xdist: workers report here

    def _evidence(self) -> dict[str, Any]:
        """This process's counts and divergences, as plain data (what an xdist worker sends the controller)."""
        return {
            "stats": {name: {k: getattr(s, k) for k in _COUNTS} for name, s in self.monitor.stats().items()},
            "divergences": [(d.test, d.phase, d.describe()) for found in self.divergences.values() for d in found],
        }

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        workeroutput = getattr(session.config, "workeroutput", None)
        if workeroutput is not None:  # an xdist worker: its evidence goes to the controller's summary
            workeroutput["npu_shadow"] = self._evidence()

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        """An xdist worker finished: its counts and divergences join this (the controller's) summary."""
        gateway = getattr(node, "gateway", None)
        worker = str(getattr(gateway, "id", None) or getattr(node, "workerinput", {}).get("workerid", "?"))
        output = getattr(node, "workeroutput", None)
        if not isinstance(output, dict) or "npu_shadow" not in output:
            why = f"it ended without reporting ({label_text(str(error), 120)})" if error else "it sent no evidence"
            self.workers_missing.append((worker, why))
            return
        evidence, why = worker_evidence(output["npu_shadow"])
        if evidence is None:
            self.workers_missing.append((worker, f"its evidence was refused: {why}"))
        else:
            self.workers.append(evidence)

    # ------------------------------------------------------------------ the end

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        write = terminalreporter.write_line
        terminalreporter.section("npu-shadow")
        workers = f" (merged from {len(self.workers)} xdist workers)" if self.workers else ""
        write(f"legacy: {self.legacy}; journal: {self.journal_path}{workers}")
        write(
            f"{'target':<16}{'calls':>8}{'compared':>10}{'match':>8}{'close':>7}{'mismatch':>10}{'error':>7}{'skipped':>9}"
        )
        evidence = [self._evidence(), *self.workers]
        totals: dict[str, collections.Counter[str]] = {}
        for part in evidence:
            for name, counts in part["stats"].items():
                totals.setdefault(name, collections.Counter()).update(counts)
        for name, s in totals.items():
            write(
                f"{name:<16}{s['calls']:>8}{s['compared']:>10}{s['match']:>8}{s['close']:>7}{s['mismatch']:>10}"
                f"{s['error']:>7}{s['skipped']:>9}"
            )
        for worker, why in self.workers_missing:
            write(f"missing from this summary: xdist worker {worker}: {why} (the journal holds what it wrote)")
        divergences = [d for part in evidence for d in part["divergences"]]
        if not divergences:
            write("no divergence")
        for test, phase, text in sorted(divergences, key=lambda d: not d[0]):  # (those of a test first)
            if test:
                write(f"diverged: {test} ({phase}): {text}")
            else:
                write(f"diverged outside a test ({phase}): {text}")

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.monitor.uninstall()
        self.journal.close()
        self._undo_legacy()


def _emulate_npu(config: pytest.Config) -> None:
    devices = config.getoption("npu_shadow_emulate_npu")
    if devices:
        from shadow.npu import emulated

        try:
            emulated.install(devices)
        except (emulated.EmulatorUnavailable, ValueError) as exc:
            raise pytest.UsageError(f"--npu-shadow-emulate-npu: {exc}") from None


class UpstreamWorld:
    """``--npu-shadow-world upstream``: the suite runs with torch_npu's patches removed (upstream's functions where
    the patches were) and nothing shadowed: the second run of a suite A/B (``npu-shadow ab``)."""

    def __init__(self, config: pytest.Config) -> None:
        from shadow.core.model import live_targets
        from shadow.core.model.targets import BUILTINS, PLACES, patch_origin

        _emulate_npu(config)
        if config.getoption("npu_shadow_legacy") != "reference" and importlib.util.find_spec("torch_npu") is not None:
            try:
                import torch_npu  # noqa: F401  (it patches torch; the patches are removed below)
            except Exception as exc:
                raise pytest.UsageError(f"--npu-shadow-world upstream: cannot import torch_npu: {exc}") from None
        self._removed: list[tuple[Any, str, Any]] = []
        for name, (owner_of, attribute) in {**PLACES, **live_targets.ARM_PLACES}.items():
            owner = owner_of()
            current = getattr(owner, attribute, None)
            if patch_origin(current) is None:
                continue
            upstream = BUILTINS[name]().upstream if name in BUILTINS else live_targets.upstream(name)
            if upstream is not None:
                self._removed.append((owner, attribute, current))
                setattr(owner, attribute, upstream)

    def header(self) -> str:
        removed = ", ".join(f"{getattr(o, '__name__', o)}.{a}" for o, a, _ in self._removed) or "none were installed"
        return f"npu-shadow: upstream world, torch_npu's patches removed ({removed})"

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        terminalreporter.section("npu-shadow")
        terminalreporter.write_line(self.header())

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        for owner, attribute, patch in reversed(self._removed):
            setattr(owner, attribute, patch)
