"""Run torch_npu's own tests (a checkout of the Ascend/pytorch repository) on the emulated npu twice, unshadowed and
under ``npu-shadow run --legacy-from RELEASE --sample-rate 1`` (``--strict``: under the pytest plugin's strict mode,
``pytest --npu-shadow --npu-shadow-strict``, where a divergence fails the test that made the call), and say what the
monitor changed and what it found:

    python scripts/torch_npu_tests.py --checkout PATH [--release 2.14.0] [--strict] [--support FILE ...] [TEST ...]

``--support`` names files the tests import that are no tests (Ascend's ``test/url.py`` and ``url.ini`` beside its
copy of PyTorch's ``test_serialization.py``: ``git show v2.5.1-7.1.0:test/test_serialization.py`` in a checkout).

The tests import ``torch_npu``: a rehearsal one (scripts/rehearsal_torch_npu) gives them the surface they use over the
emulated npu; the patches under test are the release's own, from its wheel's source. Every test's outcome in the
shadowed run must be its outcome unshadowed (a flip is the monitor changing the job); the journal's counts say what
was compared, and each mismatch is printed with its detail. Exit status: 1 where an outcome flipped, else 0.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REHEARSAL = ROOT / "scripts" / "rehearsal_torch_npu"
#: torch_npu's tests of what its serialization, storage and tensor patches touch.
DEFAULT_TESTS = (
    "test/npu/test_serialization.py",
    "test/npu/test_serialization_format.py",
    "test/npu/test_storage.py",
    "test/npu/test_tensor.py",
    "test/npu/test_tensors.py",
)


def outcomes(report: Path) -> dict[str, str]:
    """{class::test: passed|failed|error|skipped} from a JUnit XML report."""
    found = {}
    for case in ElementTree.parse(report).iter("testcase"):
        kinds = {child.tag for child in case}
        outcome = next((k for k in ("failure", "error", "skipped") if k in kinds), "passed")
        found[f"{case.get('classname')}::{case.get('name')}"] = {"failure": "failed"}.get(outcome, outcome)
    return found


def counts(journal: Path) -> dict[str, collections.Counter]:
    """Each target's outcomes (and skips by reason) over the run, from the journal's count records (cumulative: a
    process's last record of a target and primary side holds all it counted)."""
    last = {}
    for line in (journal.read_text() if journal.exists() else "").splitlines():
        record = json.loads(line)
        if record.get("event") == "counts":
            last[(record.get("pid"), record["target"], record["primary"])] = record
    found: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for record in last.values():
        for by_outcome in record["outcomes"].values():
            found[record["target"]].update(by_outcome)
        for reasons in record["skipped"].values():
            found[record["target"]].update({f"skipped: {reason}": n for reason, n in reasons.items()})
    return found


def differences(journal: Path) -> list[dict]:
    """The journal's observations that are not matches (mismatch, error, close)."""
    found = []
    for line in (journal.read_text() if journal.exists() else "").splitlines():
        record = json.loads(line)
        if record.get("outcome") in ("mismatch", "error", "close"):
            found.append(record)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", required=True, help="a checkout of github.com/Ascend/pytorch")
    parser.add_argument("--release", default="2.14.0", help="the torch_npu release whose patches are shadowed")
    parser.add_argument("--strict", action="store_true", help="the shadowed run under pytest --npu-shadow-strict")
    parser.add_argument("--support", nargs="*", default=[], help="files the tests import, relative to the checkout")
    parser.add_argument("tests", nargs="*", default=list(DEFAULT_TESTS), help="test files, relative to the checkout")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from shadow.npu.wheels import cached_wheel

    wheel = cached_wheel(args.release)
    if wheel is None:
        print(f"no cached wheel of torch_npu {args.release}: bash scripts/fetch_torch_npu.sh {args.release}")
        return 2
    with tempfile.TemporaryDirectory(prefix="torch-npu-tests-") as work:
        directory = Path(work)
        files = []
        for test in args.tests:  # (copied alone: the checkout's conftest files are not this run's)
            shutil.copy(Path(args.checkout) / test, directory / Path(test).name)
            files.append(Path(test).name)
        for support in args.support:
            shutil.copy(Path(args.checkout) / support, directory / Path(support).name)
        env = dict(os.environ, TORCH_NPU_TESTS_WHEEL=str(wheel))
        env["PYTHONPATH"] = os.pathsep.join([str(REHEARSAL), str(ROOT), env.get("PYTHONPATH", "")])
        pytest = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-p", "no:randomly"]
        plain = subprocess.run([*pytest, "--junitxml=plain.xml", *files], cwd=directory, env=env,
                               capture_output=True, text=True)  # fmt: skip
        journal = directory / "journal.jsonl"
        if args.strict:  # (the plugin shadows every call, strict: a divergence fails its test)
            strict = [f"--npu-shadow-legacy-from={wheel}", f"--npu-shadow-journal={journal}"]
            command = [*pytest, "--npu-shadow", "--npu-shadow-strict", "--npu-shadow-emulate-npu=2", *strict]
        else:
            command = [
                sys.executable, "-m", "shadow", "run", "--emulate-npu", "2", "--legacy-from", str(wheel),
                "--sample-rate", "1", "--budget", "off", "--journal", str(journal), "--journal-all", "--", *pytest,
            ]  # fmt: skip
        shadowed = subprocess.run([*command, "--junitxml=shadowed.xml", *files], cwd=directory, env=env,
                                  capture_output=True, text=True)  # fmt: skip
        if not (directory / "plain.xml").exists() or not (directory / "shadowed.xml").exists():
            print(plain.stdout[-3000:], plain.stderr[-3000:], shadowed.stdout[-3000:], shadowed.stderr[-3000:])
            return 2
        before, after = outcomes(directory / "plain.xml"), outcomes(directory / "shadowed.xml")
        tally = collections.Counter(before.values())
        print(f"torch_npu {args.release}'s tests, {len(files)} files: {len(before)} tests, unshadowed "
              + ", ".join(f"{n} {kind}" for kind, n in sorted(tally.items())))  # fmt: skip
        flips = {test: (before.get(test), after.get(test)) for test in set(before) | set(after)
                 if before.get(test) != after.get(test)}  # fmt: skip
        print(f"outcomes that differ under the monitor: {len(flips)}")
        for test, (was, now) in sorted(flips.items()):
            print(f"  {test}: {was} -> {now}")
        print("what the monitor compared (journal counts, every call sampled):")
        for target, found in sorted(counts(journal).items()):
            print(f"  {target}: " + ", ".join(f"{kind} {n}" for kind, n in sorted(found.items())))
        for record in differences(journal):
            where = record.get("test") or ""
            print(f"  {record['outcome']}: {record['target']} {record.get('signature', '')} {where}\n"
                  f"    {str(record.get('detail', ''))[:400]}")  # fmt: skip
        summary = [line for line in shadowed.stderr.splitlines() if line.startswith("npu-shadow patches:")]
        print("\n".join(summary))
        return 1 if flips else 0


if __name__ == "__main__":
    sys.exit(main())
