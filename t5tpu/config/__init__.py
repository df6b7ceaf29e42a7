"""Gin, and only here: finding and parsing the configuration files, checking the macros' values,
a checkpoint's model gin files read apart, and a runner's bound settings as a typed object."""
