"""`t5tpu serve`: a loaded model behind HTTP, requests decoded together in dynamic batches."""
