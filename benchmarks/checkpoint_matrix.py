"""torch_load over a matrix of real checkpoints: torchvision's models (random init) saved as state dicts, as
ImageNet-style training checkpoints (state dict, optimizer state after a step, an ``argparse.Namespace``, the best
accuracy as a tensor) and as whole models; in the zip and legacy formats; loaded with ``weights_only`` true and false,
every kind of ``map_location`` and ``mmap``. Legacy is torch_npu's own ``torch.load`` from a wheel.

For each load it checks what the job got (the shadowed load's result against the unwrapped load's, compared as what
they are, or the same exception) and counts the monitor's outcomes: a mismatch or an error is a false divergence
(legacy and upstream load these alike). Run where torchvision can be imported (it is not a dependency)::

    python benchmarks/checkpoint_matrix.py [--wheel 2.13.0] [--models resnet18,mobilenet_v3_small] [--trusted]
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import shadow
from shadow.core.judging.compare import compare
from shadow.core.model import live_targets, loaded
from shadow.npu import torch_npu_source, wheels

MAPS: dict[str, Any] = {
    "none": None,
    "str": "cpu",
    "device": torch.device("cpu"),
    "callable": lambda storage, location: storage,
    "dict": {"cpu": "cpu"},
}


def _checkpoints(model_name: str, torchvision: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    model = getattr(torchvision.models, model_name)(weights=None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3, 64, 64)).sum().backward()
    optimizer.step()
    imagenet = {
        "epoch": 3,
        "arch": model_name,
        "state_dict": model.state_dict(),
        "best_acc1": torch.tensor(71.5),
        "optimizer": optimizer.state_dict(),
        "args": argparse.Namespace(arch=model_name, lr=0.1, epochs=90, workers=4),
    }
    return {"state_dict": model.state_dict(), "imagenet": imagenet, "whole": model}


def _outcome(load: Any) -> tuple[Any, BaseException | None]:
    try:
        return load(), None
    except Exception as exc:
        return None, exc


def _text(error: BaseException) -> str:
    """An exception's text without torch_npu's error-code suffix, which carries the second it was raised in."""
    return re.sub(r"\[ERROR\] [^\n]*", "[ERROR] ...", str(error))


def _same(first: tuple[Any, BaseException | None], second: tuple[Any, BaseException | None]) -> bool:
    (value, error), (other, other_error) = first, second
    if error is not None or other_error is not None:
        return type(error) is type(other_error) and _text(error) == _text(other_error)
    return compare(loaded.comparable(value), loaded.comparable(other), exact=True).outcome == "match"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--wheel", default="2.13.0", help="torch_npu release (cached) or wheel whose torch.load is legacy"
    )
    parser.add_argument(
        "--models", default="resnet18,mobilenet_v3_small,squeezenet1_0,shufflenet_v2_x0_5,regnet_x_400mf"
    )
    parser.add_argument("--trusted", action="store_true", help="trust the checkpoints (compare loads that run code)")
    options = parser.parse_args()
    import torchvision

    from shadow.npu import emulated

    if torch.accelerator.current_accelerator() is None:
        emulated.install(2)  # (torch_npu's legacy runs over an accelerator: the emulated npu where none is here)
    wheel = wheels.cached_wheel(options.wheel) or options.wheel
    patches = torch_npu_source.load(str(wheel)).patch_torch()
    outcomes: collections.Counter[str] = collections.Counter()
    changed: list[str] = []
    cases = 0
    try:
        with tempfile.TemporaryDirectory() as folder:
            for model_name in options.models.split(","):
                for kind, obj in _checkpoints(model_name, torchvision).items():
                    for fmt in ("zip", "legacy"):
                        path = os.path.join(folder, f"{model_name}-{kind}-{fmt}.pt")
                        torch.save(obj, path, _use_new_zipfile_serialization=fmt == "zip")
                        matrix = itertools.product((True, False), MAPS, (False, True))
                        for weights_only, location, mmap in matrix:
                            kwargs = {"map_location": MAPS[location], "weights_only": weights_only, "mmap": mmap}
                            cases += 1

                            def load(path: str = path, kwargs: dict = kwargs) -> Any:
                                return torch.load(path, **kwargs)  # (torch.load looked up at each call: shadowed)

                            alone = _outcome(load)
                            target = live_targets.torch_load(trusted=options.trusted)
                            with shadow.install([target], sample_rate=1.0, budget=None, deadline=None) as monitor:
                                shadowed = _outcome(load)
                                stats = monitor.stats()["torch_load"]
                            for name in ("match", "close", "mismatch", "error"):
                                outcomes[name] += getattr(stats, name)
                            for reason, count in stats.by_reason.items():
                                outcomes[f"reason {reason}"] += count
                            if not _same(alone, shadowed):
                                changed.append(
                                    f"{model_name}/{kind}/{fmt}/wo={weights_only}/map={location}/mmap={mmap}"
                                )
    finally:
        patches.undo()
    false = outcomes["mismatch"] + outcomes["error"]
    print(f"{cases} loads: {dict(outcomes)}")
    print(f"false divergences: {false}; the job's result changed in {len(changed)}: {changed[:5]}")
    return 1 if false or changed else 0


if __name__ == "__main__":
    sys.exit(main())
