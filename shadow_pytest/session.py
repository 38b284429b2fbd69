"""The ``--npu-shadow`` session: legacy patched, monitor installed, every observation attributed to its test."""

from __future__ import annotations

import collections
import dataclasses
import importlib.metadata
import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest

from exporters import JsonlExporter
from shadow.core.monitor import install
from shadow.core.observation import DIVERGENT_OUTCOMES, Observation, bounded
from shadow.npu import reference, torch_npu_source

DIVERGENT = DIVERGENT_OUTCOMES


@dataclasses.dataclass(frozen=True)
class Divergence:
    """One divergent observation, and where in the run it happened."""

    test: str  # node id, or "" outside a test
    phase: str  # setup, call, teardown, or collection/between tests
    observation: Observation

    def describe(self) -> str:
        o = self.observation
        reasons = f" ({', '.join(o.reasons)})" if o.reasons else ""
        return f"{o.target} {o.outcome}{reasons} [{o.signature}]: {bounded(o.detail, 300)}"


class ShadowSession:
    """A pytest plugin object: registered by :func:`shadow_pytest.pytest_configure` when enabled."""

    def __init__(self, config: pytest.Config) -> None:
        option = config.getoption
        self.strict = option("npu_shadow_strict")
        self.where: tuple[str, str] = ("", "collection")
        self.divergences: dict[tuple[str, str], list[Divergence]] = collections.defaultdict(list)
        self.diverged_tests: dict[str, list[Divergence]] = {}
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
        try:
            self.monitor = install(
                names,
                sample_rate=1.0,
                exporters=[self, self.journal],
                seed=0,
                yields=True,
                pure_hooks=option("npu_shadow_pure_hooks"),
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

    # ------------------------------------------------------------------ the end

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        write = terminalreporter.write_line
        terminalreporter.section("npu-shadow")
        write(f"legacy: {self.legacy}; journal: {self.journal_path}")
        write(
            f"{'target':<16}{'calls':>8}{'compared':>10}{'match':>8}{'close':>7}{'mismatch':>10}{'error':>7}{'skipped':>9}"
        )
        for name, s in self.monitor.stats().items():
            write(
                f"{name:<16}{s.calls:>8}{s.compared:>10}{s.match:>8}{s.close:>7}{s.mismatch:>10}{s.error:>7}"
                f"{s.skipped:>9}"
            )
        if not self.diverged_tests and not any(not test for test, _ in self.divergences):
            write("no divergence")
        for test, found in self.diverged_tests.items():
            for divergence in found:
                write(f"diverged: {test} ({divergence.phase}): {divergence.describe()}")
        for (test, phase), found in self.divergences.items():
            if not test:
                for divergence in found:
                    write(f"diverged outside a test ({phase}): {divergence.describe()}")

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.monitor.uninstall()
        self.journal.close()
        self._undo_legacy()
