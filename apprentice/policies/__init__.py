"""Policies: a batch of conversations in, a batch of assistant messages out."""
