"""Episodes: the batched multi-episode engine and its crash-safe shards."""
