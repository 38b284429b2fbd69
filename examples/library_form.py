"""The library form: shadow a block of your own code, then read the counts."""

import torch

import shadow
from shadow.npu import reference

reference.patch_torch()  # on an NPU host, `import torch_npu` does this

model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

with shadow.install(["tensor_type"], sample_rate=0.5, seed=0) as monitor:
    for _ in range(20):
        loss = model(torch.randn(16, 8).type(torch.float32)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

for name, stats in monitor.stats().items():
    print(name, stats)
