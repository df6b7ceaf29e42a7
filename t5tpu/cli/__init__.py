"""The command line: parsing, per-command help, process setup, dispatch to a runner or tool."""
