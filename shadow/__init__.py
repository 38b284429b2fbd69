"""npu-shadow: run torch_npu's legacy patches and upstream PyTorch side by side on sampled calls.

>>> import shadow
>>> with shadow.install(sample_rate=0.01) as monitor:
...     train()
>>> monitor.stats()
"""

from shadow.compare import Comparison, compare
from shadow.engine import Shadow
from shadow.launch import install_from_env
from shadow.monitor import Monitor, install
from shadow.observation import (
    HARD_REASONS,
    MISMATCH_REASONS,
    OUTCOMES,
    SKIP_REASONS,
    Observation,
    TargetStats,
)
from shadow.targets import BUILTINS, Target
from shadow.tolerance import Tolerance

__version__ = "0.1.0"

__all__ = [
    "BUILTINS",
    "HARD_REASONS",
    "MISMATCH_REASONS",
    "OUTCOMES",
    "SKIP_REASONS",
    "Comparison",
    "Monitor",
    "Observation",
    "Shadow",
    "Target",
    "TargetStats",
    "Tolerance",
    "__version__",
    "compare",
    "install",
    "install_from_env",
]
