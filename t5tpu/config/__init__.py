"""Gin: finding and parsing the configuration files, and checking the macros' values."""
