"""batchgen's kernels: each op's Triton kernel and CPU launcher beside its torch reference (kernels.ops).

Hugging Face ships a distribution whose import name is also `kernels`; transformers 5.25 requires it
and imports names from it when it builds a model, which finds this package instead (the repository
root comes first on sys.path). Those names get an ImportError that says so, not a bare "cannot import
name"; the project pins transformers below 5.25 and `make setup` removes that distribution."""

# what transformers imports from Hugging Face's `kernels` (transformers/integrations/hub_kernels.py)
_HUB_KERNELS_NAMES = frozenset({
    "CUDAProperties", "Device", "KernelizeFallback", "LayerRepository", "LocalLayerRepository", "Mode",
    "ROCMProperties", "get_kernel", "kernelize", "register_kernel_mapping", "replace_kernel_forward_from_hub",
    "use_kernel_forward_from_hub", "use_kernel_mapping", "use_kernelized_func",
})


def __getattr__(name: str):
    if name in _HUB_KERNELS_NAMES:
        raise ImportError(
            f"{name!r} is Hugging Face's `kernels` package, which this batchgen `kernels` package shadows: "
            "transformers >= 5.25 installs and imports it. Use transformers < 5.25 "
            "(pip install 'transformers<5.25') and remove it (pip uninstall kernels)")
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
