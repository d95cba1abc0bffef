from tests.kernels.variants import cpu_variant  # noqa: F401 (a fixture)
