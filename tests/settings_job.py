"""A job whose second thread keeps changing torch's process-wide settings while its main thread trains a TorchScript
model (Embedding, LayerNorm, torch.matmul) and prints, saves and loads tensors: writes the trained parameters and
how many of the other thread's changes it found undone to OUT (a changed setting read back as it was before).

    python tests/settings_job.py OUT
"""

import io
import sys
import threading

import torch


class Scripted(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(16, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(self.embedding(tokens))
        return torch.matmul(hidden, hidden.transpose(0, 1))


#: (change to, change back, read) of settings that change no number the training computes.
SETTINGS = [
    (lambda: torch.set_printoptions(precision=3), lambda: torch.set_printoptions(precision=4),
     lambda: torch._tensor_str.PRINT_OPTS.precision, 3, 4),
    (lambda: torch.backends.mha.set_fastpath_enabled(False), lambda: torch.backends.mha.set_fastpath_enabled(True),
     torch.backends.mha.get_fastpath_enabled, False, True),
    (lambda: torch.set_warn_always(True), lambda: torch.set_warn_always(False), torch.is_warn_always_enabled,
     True, False),
]  # fmt: skip


def other_thread(stop: threading.Event, undone: list) -> None:
    while not stop.is_set():
        for change, back, read, changed, initial in SETTINGS:
            change()
            stop.wait(0.002)
            if read() != changed:
                undone.append(1)
            back()
            stop.wait(0.002)
            if read() != initial:
                undone.append(1)


def main() -> None:
    torch.manual_seed(0)
    model = torch.jit.script(Scripted())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    stop, undone = threading.Event(), []
    changer = threading.Thread(target=other_thread, args=(stop, undone))
    changer.start()
    try:
        for step in range(40):
            tokens = torch.arange(step % 5, step % 5 + 6)
            loss = model(tokens).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            text = repr(loss.detach())
            buffer = io.BytesIO()
            torch.save({"w": model.norm.weight.detach().clone()}, buffer)
            buffer.seek(0)
            torch.load(buffer)
            loss.detach().type(torch.float64)
            assert text
    finally:
        stop.set()
        changer.join()
    with open(sys.argv[1], "wb") as out:
        torch.save({"parameters": [p.detach() for p in model.parameters()], "undone": len(undone)}, out)


if __name__ == "__main__":
    main()
