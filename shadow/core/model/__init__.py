"""The vocabulary (outcomes, reasons, observations) and what is shadowed: targets, tolerances, oracles."""
