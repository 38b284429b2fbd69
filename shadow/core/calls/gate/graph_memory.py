"""Whether a backward comparison's graphs fit in the device memory the shadow side may add.

A backward comparison keeps two forward graphs of the call alive at once (upstream's, from the shadow run, and
legacy's, run again for its own graph), each about what the primary's forward allocated: on a training step's
forward, the activations, often most of the job's peak. Everything else the shadow side runs keeps no activations.
So the backward comparison is what can double a job's device memory, and it is bounded here: with a share set
(``Settings.backward_memory``; the launcher's default 0.3), one is made only where its two graphs take at most that
share of the job's own footprint.

Both figures are read around the primary's runs of sampled calls (an allocator's counters: no wait for the device):
the job's footprint is the most allocated just after a primary returned (the job's parameters, optimizer state and
this step's activations; the shadow side holds nothing then), and a signature's graph is the most a primary run of
it allocated (runs with grad mode on only: a forward without a graph is no measure of one). A backward comparison
drawn for a signature never measured yet, or whose graphs would not fit, is not made: backward skip ``memory``.
"""

from __future__ import annotations

#: Forward graphs a backward comparison holds at once (upstream's and legacy's again; the A/A run's comes after).
GRAPHS = 2


class GraphMemory:
    """The job's footprint and each signature's forward graph, as the primary's runs showed them, against ``share``
    (the most a backward comparison's graphs may add, as a share of the footprint)."""

    def __init__(self, share: float) -> None:
        self.share = share
        self.footprint = 0
        self._graphs: dict[str, int] = {}

    def observe(self, signature: str, before: int, after: int) -> None:
        """A primary's run of ``signature``: the bytes allocated on the accelerator's devices ``before`` and ``after``
        it."""
        self.footprint = max(self.footprint, after)
        self._graphs[signature] = max(self._graphs.get(signature, 0), after - before)

    def refuses(self, signature: str) -> bool:
        """Whether a backward comparison of ``signature`` is not to be made: never measured, or too large."""
        graph = self._graphs.get(signature)
        return graph is None or GRAPHS * graph > self.share * self.footprint
