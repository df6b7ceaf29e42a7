"""The T5 network (flax linen, T5X parameter names and logical axes), its loss, scoring and
decoding."""
