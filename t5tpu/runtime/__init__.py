"""The process around the model: quiet, lazy imports of TensorFlow and seqio, the persistent
compilation cache, host memory limits."""
