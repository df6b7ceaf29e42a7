"""Helper commands that parse their own flags: the benchmark, Quora data preparation."""
