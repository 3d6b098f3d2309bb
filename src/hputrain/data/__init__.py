"""Data: batches of a data set for each rank and micro-batch, collators (padding, length buckets),
the built-in corpus, and worker processes that prepare batches ahead (workers.py)."""
