"""A small real training job: a CNN with BatchNorm and Dropout on images it generates itself.

It uses DataParallel when more than one accelerator device is present (and, every fourth step, the
functional `torch.nn.parallel.data_parallel`), DistributedDataParallel (gloo on CPU) when started by
torchrun, and `.type()` casts where legacy code typically has them (in the dataset, on the batch with
npu type names and classes when an npu is present, on the loss). `--autocast` runs every other step's
forward under the accelerator's float16 autocast. On a host without torch_npu it installs
shadow.npu.reference's legacy patches, so that a shadowed run has something to compare, and says so. It
knows nothing of npu-shadow's monitor: run it under `npu-shadow run` to shadow it.

    npu-shadow run --sample-rate 0.1 --port 9464 -- python examples/train_dataparallel.py
    npu-shadow run --emulate-npu 2 -- python examples/train_dataparallel.py --autocast  # 2 emulated npus
    python examples/train_dataparallel.py --emulate-npu 2                              # unshadowed
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class Shapes(Dataset):
    """Deterministic synthetic images: class k is a bright square at one of four places, plus noise."""

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed = size, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + index)
        label = index % 4
        image = torch.randn(3, 16, 16, generator=generator) * 1.5
        row, col = divmod(label, 2)
        image[:, row * 8 : row * 8 + 8, col * 8 : col * 8 + 8] += 1.0
        return image.type(torch.float32), label  # a legacy-style cast, in the DataLoader worker


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2), nn.Dropout(0.2)
        )
        self.head = nn.Linear(16 * 8 * 8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def use_legacy_patches(worker_id: int | None = None) -> None:
    """torch_npu patches torch in every process that imports it; the rehearsal does the same, unless legacy
    patches are in place already (``Tensor.type_raw`` is torch_npu's mark: `npu-shadow run --legacy-from`
    installs torch_npu's own code that way)."""
    if importlib.util.find_spec("torch_npu") is not None:
        import torch_npu  # noqa: F401  (patches torch)
    elif "type_raw" in vars(torch.Tensor):
        if worker_id is None:
            print("legacy patches already installed: using them")
    else:
        from shadow.npu import reference

        reference.patch_torch()
        if worker_id is None:
            print("torch_npu not installed: using shadow.npu.reference's legacy patches (a rehearsal)")


def progress(step: int, total: int, loss: float, started: float) -> None:
    width = 30
    done = width * step // total
    bar = "#" * done + "." * (width - done)
    # (a loss that falls below 1e-4 keeps its digits: 4.53e-05, never 0.0000)
    sys.stderr.write(f"\r[{bar}] {step}/{total} loss {loss:.3g} {time.monotonic() - started:.1f}s")
    sys.stderr.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes (spawned)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="save the trained weights here")
    parser.add_argument("--linger", type=float, default=0.0, help="seconds to wait before exiting (for scrapes)")
    parser.add_argument("--emulate-npu", type=int, default=0, metavar="N", help="train on N emulated npu devices")
    parser.add_argument("--autocast", action="store_true", help="float16 autocast on every other step")
    args = parser.parse_args()
    # DataParallel's gradient reduction asks for NCCL on any accelerator; builds without it say so each step
    warnings.filterwarnings("ignore", "PyTorch is not compiled with NCCL support")

    if args.emulate_npu:  # before any Tensor.type(str) call (under `npu-shadow run --emulate-npu`, already done)
        from shadow.npu import emulated

        emulated.install(args.emulate_npu)
    use_legacy_patches()
    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    rank = 0
    if distributed:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    torch.manual_seed(args.seed)
    accelerator = torch.accelerator.current_accelerator()
    device = torch.device(accelerator.type if accelerator is not None else "cpu")
    net = Net().to(device)
    model: nn.Module = net
    device_ids = None
    if distributed:
        model = nn.parallel.DistributedDataParallel(net)
    elif accelerator is not None and torch.accelerator.device_count() > 1:
        device_ids = list(range(torch.accelerator.device_count()))
        model = nn.DataParallel(net, device_ids=device_ids)
    npu = getattr(torch, "npu", None) if device.type == "npu" else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    dataset = Shapes(args.samples, args.seed)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed) if distributed else None
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=sampler is None,
        sampler=sampler,
        num_workers=args.workers,
        multiprocessing_context="spawn" if args.workers else None,
        worker_init_fn=use_legacy_patches,
        generator=torch.Generator().manual_seed(args.seed),
    )
    total, step, started = args.epochs * len(loader), 0, time.monotonic()
    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        model.train()
        epoch_loss = 0.0
        for images, labels in loader:
            if npu is not None:  # legacy-style casts onto the npu: a type name, and a tensor type class
                images, labels = images.type("torch.npu.FloatTensor"), labels.type(npu.LongTensor)
            else:
                images, labels = images.to(device).type(torch.float32), labels.to(device)
            autocast = torch.autocast(device.type, dtype=torch.float16) if args.autocast and step % 2 else None
            with autocast or contextlib.nullcontext():
                if device_ids and step % 4 == 3:
                    logits = nn.parallel.data_parallel(net, images, device_ids=device_ids)
                else:
                    logits = model(images)
            loss = nn.functional.cross_entropy(logits.float(), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            epoch_loss += loss.type(torch.float64).item()
            step += 1
            if rank == 0:
                progress(step, total, loss.item(), started)
        if rank == 0:
            sys.stderr.write("\n")  # (the progress bar's line ends before the epoch's)
            sys.stderr.flush()
            print(f"epoch {epoch}: mean loss {epoch_loss / len(loader):.4g}", flush=True)
    if args.out and rank == 0:
        module = model.module if hasattr(model, "module") else model
        torch.save(module.state_dict(), args.out)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    time.sleep(args.linger)


if __name__ == "__main__":
    main()
