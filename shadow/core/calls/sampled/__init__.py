"""One sampled call: its eligibility, plan, primary and shadow side, findings and extra runs."""
