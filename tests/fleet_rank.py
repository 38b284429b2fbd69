"""One rank of a fleet rehearsal job (run by torchrun under `npu-shadow run --emulate-npu 2`): gloo on the CPU,
`.type()` with npu names on the emulated npu, and with --dp DataParallel over the two emulated devices; then it
waits for the stop file, so that the last counts are scraped."""

import argparse
import os
import time

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--calls", type=int, default=25)
parser.add_argument("--dp", action="store_true")
parser.add_argument("--stop", required=True)
parser.add_argument("--done", required=True, help="this rank writes PREFIX<rank> when its calls are made")
args = parser.parse_args()

dist.init_process_group("gloo")
x = torch.ones(4, device="npu:0")
for _ in range(args.calls):
    x.type("torch.npu.HalfTensor")
if args.dp:
    model = torch.nn.DataParallel(torch.nn.Linear(4, 2).to("npu:0"), device_ids=[0, 1])
    for _ in range(3):
        model(torch.randn(8, 4, device="npu:0")).sum().backward()
total = torch.tensor([1.0])
dist.all_reduce(total)  # (the ranks really form one job)
assert total.item() == dist.get_world_size()
with open(f"{args.done}{dist.get_rank()}", "w") as done:
    done.write("done\n")
deadline = time.monotonic() + 240
while not os.path.exists(args.stop) and time.monotonic() < deadline:
    time.sleep(0.1)
dist.destroy_process_group()
