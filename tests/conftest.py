import os

import pytest
from hypothesis import settings

# The Triton interpreter runs kernels on CPU tensors. Triton reads this flag when a @triton.jit
# function is defined, so it must be set before anything imports kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")

# The suite runs engines side by side (this process's models beside the workers it starts), where
# OpenMP threads that spin between parallel regions hold the cores the others need: no spinning
# (`batchgen` spins briefly by default, engine/openmp.py, for an engine alone on its cores).
# Inherited by the worker processes the tests start.
os.environ.setdefault("GOMP_SPINCOUNT", "0")

# Hypothesis reads no config file, so its profiles live here. In CI (any non-empty $CI) every
# property test draws the same examples on every run (derandomize: the seed comes from the test's
# source), so a rare example cannot fail one run and pass the next; the example database stays off
# there as well. Locally the default profile keeps exploring new examples.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

# dtype "auto" on the CPU follows the CPU's features (bf16 where native): pinned to fp32 here so the
# suite's results do not depend on the machine that runs it
os.environ.setdefault("BATCHGEN_CPU_DTYPE", "float32")


@pytest.fixture
def kernel_options():
    """Kernel variants for one test: kernel_options(amx=False, ...) changes the process's KernelOptions
    (kernels/options.py) through kernels.ops.configure; they come back as they were after the test."""
    from dataclasses import replace

    from kernels import ops, options

    before = options.current()

    def use(**changes):
        ops.configure(replace(options.current(), **changes))
        return options.current()

    yield use
    if options.current().isa != "auto":  # "auto" keeps the process's variant: back to the best one
        from kernels import cpu_native

        cpu_native.use(None)
    ops.configure(before)
