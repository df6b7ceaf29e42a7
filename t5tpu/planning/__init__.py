"""Per-device memory of a training step: estimated without allocating, and as XLA compiles it."""
