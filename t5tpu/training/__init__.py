"""The train state and step, optimizers, and preemption handling."""
