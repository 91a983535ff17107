"""pipeline/core/dtypes.py: the torch-free table of bytes per element equals
``torch.dtype.itemsize`` for every dtype name of the installed torch, and names nothing else."""

from __future__ import annotations

import pytest
import torch

from pipeline.core.dtypes import ITEMSIZE, itemsize, numel


def _torch_dtypes() -> dict[str, int]:
    return {name: getattr(torch, name).itemsize for name in dir(torch)
            if isinstance(getattr(torch, name), torch.dtype)}


def test_table_is_torch_itemsize() -> None:
    assert ITEMSIZE == _torch_dtypes()


@pytest.mark.parametrize("name", ["bfloat16", "float32", "int64", "bool", "float8_e4m3fn"])
def test_itemsize(name: str) -> None:
    assert itemsize(name) == getattr(torch, name).itemsize


@pytest.mark.parametrize("name", ["float128", "Tensor", "", "torch.float32"])
def test_unknown_dtype(name: str) -> None:
    with pytest.raises(ValueError, match="unknown dtype"):
        itemsize(name)


def test_numel() -> None:
    assert numel(()) == 1
    assert numel((3, 4, 5)) == 60
    assert numel((7, 0)) == 0
