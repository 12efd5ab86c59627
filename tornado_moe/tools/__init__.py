"""Measurement tools behind the ``tornado-moe`` subcommands: determinism checks, profiles, benchmarks.

The command-line front ends live in :mod:`tornado_moe.cli`; the logic lives here so that tests and scripts can
call it without parsing flags. Every JSON report carries the same run metadata (:mod:`.run_info`).
"""
