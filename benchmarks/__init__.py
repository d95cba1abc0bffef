"""The lab: benchmarks, baselines and profilers, kept out of the product.

Nothing in engine/, kernels/, jobs/ or dashboard/ imports from here; a benchmark may import anything
below it (tests/test_layers.py). A variant kept only to compare is an argument of a benchmark, never
a setting the product reads. Each benchmark is `batchgen bench <name>` (cli.py, plugged into the CLI
through pyproject's `batchgen.commands` entry points, as `batchgen sweep` is); the figures they
produced, with date, machine and command, are in docs/benchmarks.md. Nothing is imported here: `make
gpu-check` runs `python3 -m benchmarks.gpu_check` with only the GPU image's packages.
"""
