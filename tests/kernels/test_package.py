"""The `kernels` package name, which Hugging Face's `kernels` distribution shares (kernels/__init__.py)."""

from __future__ import annotations

import importlib.metadata

import pytest

import kernels


def test_hub_kernels_names_get_an_error_that_names_the_clash_and_the_fix():
    with pytest.raises(ImportError, match=r"'CUDAProperties' is Hugging Face's `kernels` package.*"
                                          r"pip install 'transformers<5.25'.*pip uninstall kernels"):
        from kernels import CUDAProperties  # noqa: F401  (what transformers 5.25 imports)


def test_our_modules_and_a_plain_missing_name_behave_as_usual():
    from kernels import decode_layers, ops

    assert ops.__name__ == "kernels.ops" and decode_layers.__name__ == "kernels.decode_layers"
    with pytest.raises(AttributeError, match="has no attribute 'no_such_thing'"):
        kernels.no_such_thing  # noqa: B018


def test_the_environment_has_no_hub_kernels_distribution():
    """transformers < 5.25 (pyproject) and `make setup` keep it out; with it, transformers imports
    this package in its place and fails to build any model."""
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("kernels")
