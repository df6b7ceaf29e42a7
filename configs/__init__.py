"""t5tpu's gin configs (models, topologies, runs, experiments), shipped as package data and
found with importlib.resources; the top-level configs/ directory of the repository."""
