"""Run real code nobody here wrote under the monitor and say what changed: pytorch/examples' word_language_model (an
LSTM; the whole model saved with ``torch.save`` each epoch and loaded back weights-only with ``safe_globals``), on
the emulated npu, unshadowed and under ``npu-shadow run --legacy-from RELEASE --trusted-checkpoints``:

    python scripts/real_code.py --examples PATH [--release 2.14.0] [--epochs 2]

PATH is a checkout of github.com/pytorch/examples (its code stays out of this repository). Where the checkout lacks
wikitext-2's ``train.txt`` (a shallow mirror leaves its large files out), its ``valid.txt`` stands in. Both runs must
print the same losses and save a bitwise-equal model, and the journal must hold no divergence. Exit status: 1 where
any of that fails, else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _emulated(script: str, arguments: list[str]) -> None:
    """Run ``script`` (in its own folder) on the emulated npu, unshadowed: what the job does without the monitor."""
    sys.path.insert(0, str(ROOT))
    from shadow.npu import emulated

    emulated.install(2)
    folder = os.path.dirname(os.path.abspath(script))
    os.chdir(folder)
    sys.path.insert(0, folder)
    sys.argv = [script, *arguments]
    runpy.run_path(script, run_name="__main__")


def _same_models(first: str, second: str) -> bool:
    """Whether two saved whole models hold bitwise-equal states (read on the emulated npu, where they were saved)."""
    sys.path[:0] = [str(ROOT), os.getcwd()]  # (the example's own modules: its model's class)
    import torch

    from shadow.npu import emulated

    emulated.install(2)
    states = [torch.load(path, weights_only=False).state_dict() for path in (first, second)]
    return states[0].keys() == states[1].keys() and all(
        torch.equal(states[0][k].cpu(), states[1][k].cpu()) for k in states[0]
    )


def _printed(text: str) -> list[str]:
    """What the job printed, less its timings and the monitor's own lines."""
    return [
        line for line in text.splitlines()
        if "time:" not in line and "ms/batch" not in line and not line.startswith(("npu-shadow", " ", "| epoch"))
        and not any(line.startswith(name) for name in ("torch_", "module_", "foreach", "tensor_", "storage_", "data"))
    ]  # fmt: skip


def _divergences(journal: Path) -> list[dict]:
    found = []
    for line in journal.read_text().splitlines():
        record = json.loads(line)
        if record.get("outcome") in ("mismatch", "error"):
            found.append(record)
    return found


def word_language_model(examples: Path, release: str, epochs: int, work: Path) -> bool:
    folder = work / "word_language_model"
    shutil.copytree(examples / "word_language_model", folder)
    corpus = folder / "data" / "wikitext-2"
    if not (corpus / "train.txt").is_file() or (corpus / "train.txt").stat().st_size < 1000:
        shutil.copy(corpus / "valid.txt", corpus / "train.txt")
        print("word_language_model: wikitext-2's train.txt is not in the checkout: valid.txt stands in")
    arguments = ["--epochs", str(epochs), "--emsize", "32", "--nhid", "32", "--accel", "--model", "LSTM"]
    plain = subprocess.run(
        [sys.executable, __file__, "--emulated", "main.py", *arguments, "--save", str(work / "plain.pt")],
        capture_output=True, text=True, cwd=folder, timeout=3600,
    )  # fmt: skip
    journal = work / "journal.jsonl"
    shadowed = subprocess.run(
        [sys.executable, "-m", "shadow", "run", "--emulate-npu", "2", "--legacy-from", release, "--trusted-checkpoints",
         "--journal", str(journal), "--", sys.executable, "main.py", *arguments, "--save", str(work / "shadowed.pt")],
        capture_output=True, text=True, cwd=folder, timeout=3600, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    if plain.returncode or shadowed.returncode:
        print(plain.stderr[-3000:], shadowed.stderr[-3000:])
        return False
    same_output = _printed(plain.stdout) == _printed(shadowed.stdout)
    same_model = subprocess.run(
        [sys.executable, __file__, "--same-models", str(work / "plain.pt"), str(work / "shadowed.pt")],
        capture_output=True, text=True, timeout=600, cwd=folder,
    ).stdout.strip() == "True"  # fmt: skip
    divergences = _divergences(journal)
    summary = [line for line in shadowed.stderr.splitlines() if line.split()[:1] and line.split()[0] in (
        "torch_load", "torch_save", "module_to", "storage_cpu", "tensor_repr")]  # fmt: skip
    print(f"word_language_model, legacy from {release}: same output {same_output}, bitwise-equal model {same_model}, "
          f"divergences {len(divergences)}")  # fmt: skip
    print("\n".join(summary))
    for record in divergences:
        print(f"  {record['target']} {record['outcome']} {record.get('reasons')}: {record.get('detail', '')[:300]}")
    return same_output and same_model and not divergences


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--emulated"]:
        _emulated(argv[1], argv[2:])
        return 0
    if argv[:1] == ["--same-models"]:
        print(_same_models(argv[1], argv[2]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", required=True, type=Path, help="a checkout of github.com/pytorch/examples")
    parser.add_argument("--release", default="2.14.0", help="the torch_npu release whose patches are shadowed")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        held = word_language_model(args.examples.resolve(), args.release, args.epochs, Path(work))
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
