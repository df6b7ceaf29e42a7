"""Pretrained weights in and out: Hugging Face, T5X and Mesh TF checkpoints."""
