"""The lab: benchmarks, baselines and profilers, kept out of the product.

Nothing in engine/, kernels/, jobs/ or dashboard/ imports from here; a benchmark may import anything
below it (tests/test_layers.py). A variant kept only to compare is an argument of a benchmark, never
a setting the product reads. Each module runs as `python -m benchmarks.<name>`; the figures they
produced, with date, machine and command, are in docs/benchmarks.md.
"""
