"""Demo: a small training job (conv + BatchNorm + Dropout) shadowed by npu-shadow.

On a host with torch_npu its patches are shadowed. Elsewhere the job installs shadow.reference's
legacy patches first, so there is something to compare: a rehearsal, and it says so.
Upstream parallel_apply and data_parallel need an accelerator; without one they are listed as not
exercised, never as passing.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging

import torch
from torch import nn

import shadow
from shadow import reference


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(16 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.bn(self.conv(x))))
        return self.head(h.flatten(1).type(torch.float32))  # the kind of cast legacy code is full of


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sample-rate", type=float, default=0.1)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    if importlib.util.find_spec("torch_npu") is not None:
        import torch_npu  # noqa: F401  (patches torch)

        print("torch_npu found: shadowing its patches")
    else:
        reference.patch_torch()
        print("torch_npu not installed: shadowing shadow.reference's legacy patches (a rehearsal)")

    accelerator = torch.accelerator.current_accelerator()
    targets = ["tensor_type"] + (["parallel_apply", "data_parallel"] if accelerator is not None else [])
    device = torch.device(accelerator.type if accelerator is not None else "cpu")
    torch.manual_seed(0)
    model = Net().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    with shadow.install(targets, sample_rate=args.sample_rate, seed=0) as monitor:
        for step in range(args.steps):
            x = torch.randn(32, 3, 8, 8, device=device).type(torch.float32)
            y = torch.randint(0, 10, (32,), device=device)
            out = torch.nn.parallel.data_parallel(model, x) if accelerator is not None else model(x)
            loss = nn.functional.cross_entropy(out, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step % 50 == 0:
                print(f"step {step:4d}  loss {loss.item():.4f}  ({loss.type()})")

    print(
        f"\n{'target':<16}{'calls':>8}{'sampled':>9}{'match':>7}{'close':>7}{'mismatch':>10}{'error':>7}{'skipped':>9}"
    )
    for name, s in monitor.stats().items():
        print(f"{name:<16}{s.calls:>8}{s.sampled:>9}{s.match:>7}{s.close:>7}{s.mismatch:>10}{s.error:>7}{s.skipped:>9}")
    for name in ("parallel_apply", "data_parallel"):
        if name not in monitor.targets:
            print(f"{name:<16}not exercised: upstream needs an accelerator and this host has none")


if __name__ == "__main__":
    main()
