"""Tuner: the measurement protocol and the search over decompositions."""
