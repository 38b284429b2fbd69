"""npu-shadow: run torch_npu's legacy patches and upstream PyTorch side by side on sampled calls.

>>> import shadow
>>> with shadow.install(sample_rate=0.01) as monitor:
...     train()
>>> monitor.stats()
"""

# torch first: under `npu-shadow run` the monitor is installed right after torch is imported, and it must find
# none of this package's modules half-imported (a job may import shadow before torch).
import torch  # noqa: F401  (isort: skip)

from shadow.core.compare import Comparison, compare
from shadow.core.engine import Experiment
from shadow.core.environment import VERSION
from shadow.core.exporting import Exporter
from shadow.core.monitor import Monitor, install
from shadow.core.observation import (
    HARD_REASONS,
    MISMATCH_REASONS,
    OUTCOMES,
    SKIP_REASONS,
    Observation,
    TargetStats,
)
from shadow.core.targets import BUILTINS, Target
from shadow.core.tolerance import Tolerance
from shadow.launcher.launch import install_from_env

__version__ = VERSION

__all__ = [
    "BUILTINS",
    "HARD_REASONS",
    "MISMATCH_REASONS",
    "OUTCOMES",
    "SKIP_REASONS",
    "Comparison",
    "Experiment",
    "Exporter",
    "Monitor",
    "Observation",
    "Target",
    "TargetStats",
    "Tolerance",
    "__version__",
    "compare",
    "install",
    "install_from_env",
]
