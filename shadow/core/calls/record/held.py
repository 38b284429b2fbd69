"""Value differences the noise floor cannot judge yet: held, bounded, until it can or never will."""

from __future__ import annotations

import threading

from shadow.core.judging.noise import PENDING, NoiseFloor
from shadow.core.model.observation import Observation

#: Value differences a target holds at most while its noise floor cannot judge them, in number and in bytes (more
#: are skipped at once, reason noise_pending): bounded memory, whatever the job (an output of a thousand leaves holds
#: a thousand leaf errors).
MAX_PENDING = 1000
MAX_PENDING_BYTES = 8 << 20


def held_bytes(observation: Observation) -> int:
    """About what holding ``observation`` costs: its record, its detail, and each leaf error (a tuple, its path, a
    float), as CPython allocates them (checked against tracemalloc in the tests)."""
    leaves = sum(130 + len(path) for path, _ in observation.leaf_errors)
    return 1000 + len(observation.detail) + leaves


class HeldDifferences:
    """One target's value differences held until its noise floor has the A/A runs to judge them: neither
    divergence nor agreement meanwhile."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: list[Observation] = []
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, observation: Observation) -> bool:
        """Hold ``observation``; False where MAX_PENDING, or MAX_PENDING_BYTES, are held already (it is then skipped at
        once)."""
        size = held_bytes(observation)
        with self._lock:
            if len(self._held) >= MAX_PENDING or self._bytes + size > MAX_PENDING_BYTES:
                return False
            self._held.append(observation)
            self._bytes += size
            return True

    def judged(self, signature: str, noise: NoiseFloor) -> list[tuple[Observation, str, str]]:
        """The held differences of ``signature`` the floor can judge now, each let go with its judgement (where it
        stands against its thresholds: :mod:`shadow.core.judging.noise`'s checks, and the judgement as text); those
        it still cannot judge stay held."""
        with self._lock:
            waiting = [o for o in self._held if o.signature == signature]
        found = []
        for observation in waiting:
            check, test = noise.judge(signature, observation.leaf_errors)
            if check == PENDING:
                continue
            with self._lock:
                left = [o for o in self._held if o is not observation]
                if len(left) == len(self._held):
                    continue  # (judged meanwhile on another thread)
                self._held = left
                self._bytes -= held_bytes(observation)
            found.append((observation, check, test))
        return found

    def release(self) -> list[Observation]:
        """Every difference still held, let go (the floor never had the A/A runs to judge them)."""
        with self._lock:
            held, self._held, self._bytes = self._held, [], 0
        return held
