import os

# The Triton interpreter runs kernels on CPU tensors. Triton reads this flag when a @triton.jit
# function is defined, so it must be set before anything imports kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")
