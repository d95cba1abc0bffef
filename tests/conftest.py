import os

# The Triton interpreter runs kernels on CPU tensors. Triton reads this flag when a @triton.jit
# function is defined, so it must be set before anything imports kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")
# dtype "auto" on the CPU follows the CPU's features (bf16 where native): pinned to fp32 here so the
# suite's results do not depend on the machine that runs it
os.environ.setdefault("BATCHGEN_CPU_DTYPE", "float32")
