"""The call path: install, the gate, the experiment and its shadow side, what it counts and publishes."""
