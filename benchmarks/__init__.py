"""Studies and benchmarks of hvd_compress: paper reproductions, link emulation, encoder speed.

Not part of the installed library; run from a checkout with ``python -m benchmarks``
(:mod:`benchmarks.cli`). Each study saves JSON and a PNG (``--plot DIR`` / ``--out DIR``)
and prints a table; results quoted in docs/results.md come from these commands.
"""
