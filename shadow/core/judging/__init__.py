"""Comparing two runs: values within tolerance, the noise floor, gradients, the float64 truth."""
