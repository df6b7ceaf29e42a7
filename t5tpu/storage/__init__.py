"""What a run keeps in MODEL_DIR: the layout of its files, and its checkpoints."""
