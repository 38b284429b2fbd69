"""The core: one call's way through the monitor, and the vocabulary every other layer uses.

call -> ``sampler`` -> ``engine`` (legacy, then upstream in ``isolation`` under ``global_state``) ->
``compare`` (with ``tolerance``) -> ``observation`` -> exporters. ``targets`` says what is shadowed, ``monitor``
installs it, ``oracle`` and ``drill`` are the engine's single-device check and rehearsal faults. Nothing here
imports the launcher, the analysis tools or ``exporters``.
"""
