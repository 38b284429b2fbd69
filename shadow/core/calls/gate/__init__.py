"""Which calls arrive and which are sampled: the wrapper's gate, coverage, signatures, coins, the budget."""
