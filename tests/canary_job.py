"""A canary job for the end-to-end rollback test: casts with an npu type name until told to stop, writing which
device each result landed on (legacy's cast goes to the current npu, upstream's keeps the tensor's own)."""

import argparse
import os
import time

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="npu:0", help="where the cast tensor lives (npu:1: not the current npu)")
parser.add_argument("--out", required=True)
parser.add_argument("--stop", required=True, help="the job ends when this file appears")
parser.add_argument("--seconds", type=float, default=240)
args = parser.parse_args()

torch.accelerator.set_device_index(0)
x = torch.ones(4, device=args.device)
deadline = time.monotonic() + args.seconds
with open(args.out, "a") as out:
    while time.monotonic() < deadline and not os.path.exists(args.stop):
        y = x.type("torch.npu.HalfTensor")
        out.write(f"{time.time():.3f} {y.device}\n")
        out.flush()
        time.sleep(0.05)
