"""A job of casts for the counting tests: --calls casts, then the ready file, then (once the stop file is there)
--more casts, and exit."""

import argparse
import os
import time

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--calls", type=int, required=True)
parser.add_argument("--more", type=int, default=0)
parser.add_argument("--ready", required=True)
parser.add_argument("--stop", required=True)
args = parser.parse_args()

x = torch.arange(6.0)
for i in range(args.calls):
    x.type(torch.float64 if i % 2 else torch.float32)
with open(args.ready, "w") as ready:
    ready.write("ready\n")
deadline = time.monotonic() + 240
while not os.path.exists(args.stop) and time.monotonic() < deadline:
    time.sleep(0.05)
for _ in range(args.more):
    x.type(torch.float64)
