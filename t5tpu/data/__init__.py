"""Inputs: seqio task lookup, data checks, training streams, fixed-shape batches, the vocabulary."""
