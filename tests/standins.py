"""CPU-capable stand-ins for upstream functions that need an accelerator.

torch's own ``parallel_apply`` (2.10 to 2.13) asserts an accelerator exists and ``data_parallel``
raises without one. These run the same algorithm on the CPU and keep upstream's autocast defect:
the worker threads' autocast state is read with ``torch.is_autocast_enabled()``, which answers for
CUDA only, and the autocast dtype is not passed on.
"""

import threading

import torch
from torch._utils import ExceptionWrapper


def upstream_parallel_apply(modules, inputs, kwargs_tup=None, devices=None):
    if len(modules) != len(inputs):
        raise AssertionError("modules and inputs differ in length")
    kwargs_tup = kwargs_tup if kwargs_tup is not None else ({},) * len(modules)
    grad_enabled, autocast_enabled = torch.is_grad_enabled(), torch.is_autocast_enabled()
    results, lock = {}, threading.Lock()

    def worker(i, module, input, kwargs):
        torch.set_grad_enabled(grad_enabled)
        try:
            with torch.amp.autocast("cpu", enabled=autocast_enabled):
                if not isinstance(input, (list, tuple)):
                    input = (input,)
                output = module(*input, **kwargs)
            with lock:
                results[i] = output
        except Exception:
            with lock:
                results[i] = ExceptionWrapper(where=f"in replica {i}")

    work = list(zip(modules, inputs, kwargs_tup))
    if len(work) > 1:
        threads = [threading.Thread(target=worker, args=(i, *w)) for i, w in enumerate(work)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        worker(0, *work[0])
    outputs = []
    for i in range(len(work)):
        if isinstance(results[i], ExceptionWrapper):
            results[i].reraise()
        outputs.append(results[i])
    return outputs


def upstream_data_parallel(module, inputs, device_ids=None, output_device=None, dim=0, module_kwargs=None):
    if not isinstance(inputs, tuple):
        inputs = (inputs,) if inputs is not None else ()
    return module(*inputs, **(module_kwargs or {}))
