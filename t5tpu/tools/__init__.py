"""Helper commands that parse their own flags (`t5tpu convert`, `prepare-quora`, `bench`).

Each command's module (convert.py, prepare_quora.py, bench.py) is light to import: the command
line builds its parser for --help and bad flags before anything heavy is loaded.
"""
