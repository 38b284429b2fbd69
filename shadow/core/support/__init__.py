"""Plumbing the core shares: forks, memory, the environment, safe paths, compiled code, rates, leaves."""
