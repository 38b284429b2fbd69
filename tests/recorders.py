"""An exporter that keeps every observation, for tests that look at what the monitor saw."""

import shadow


class Recorder:
    def __init__(self):
        self.observations = []

    def export(self, observation):
        self.observations.append(observation)

    def of(self, target):
        return [o for o in self.observations if o.target == target]


def shadowed(targets, **options):
    """A monitor of ``targets`` at sample rate 1.0 with seed 0 (not yet entered), and its recorder."""
    recorder = Recorder()
    return shadow.install(targets, sample_rate=1.0, exporters=[recorder], seed=0, **options), recorder
