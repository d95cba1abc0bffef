"""Which Triton the kernel tests run under: `make test-triton-compat` runs them again under the
GPU image's Triton 3.6 and sets BATCHGEN_EXPECT_TRITON, so a run that silently took the venv's newer
Triton fails here instead of passing for the wrong version. Without it, any supported Triton."""

import os

import pytest

OLDEST_SUPPORTED = (3, 6)


def test_the_expected_triton_is_the_one_imported():
    triton = pytest.importorskip("triton", reason="triton is not importable")
    version = tuple(int(x) for x in triton.__version__.split(".")[:2])
    want = os.environ.get("BATCHGEN_EXPECT_TRITON")
    if want is not None:
        assert triton.__version__.startswith(want + "."), (triton.__version__, triton.__file__)
    assert version >= OLDEST_SUPPORTED, triton.__version__
