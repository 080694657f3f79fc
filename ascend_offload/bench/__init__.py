"""Benchmarks: each module has ``main(argv) -> int``, prints a ratio against a
baseline measured in the same run, and writes JSON (``--json PATH``)."""
