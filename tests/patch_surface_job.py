"""A job that reaches a release's import-time function patches: it prints npu tensors, saves and loads a
checkpoint of them, and copies a storage to the host (tests/test_patch_calls.py runs it under the launcher)."""

import io
import sys

import torch


def main(out: str, emulate: bool) -> None:
    if emulate:  # (the unshadowed run: under `npu-shadow run --emulate-npu 2`, already done)
        from shadow.npu import emulated

        emulated.install(2)
    torch.manual_seed(0)
    device = "npu" if hasattr(torch, "npu") and torch.npu.is_available() else "cpu"
    model = torch.nn.Linear(4, 2).to(device)
    for step in range(3):
        print(f"step {step}: {model(torch.ones(1, 4, device=device))}")
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    host = model.weight.untyped_storage().cpu()
    with open(out, "wb") as handle:
        torch.save({"state": loaded, "host": torch.tensor([], dtype=torch.float32).set_(host)}, handle)


if __name__ == "__main__":
    main(sys.argv[1], "--emulate-npu" in sys.argv[2:])
