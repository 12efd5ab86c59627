"""The ``tornado-moe`` command line."""
