"""What a target counted and the exporters told of it: its record, tally, clusters, held differences."""
