"""Arrays in safetensors files with every dtype kept bit for bit (checkpoint files).

NumPy has no type of its own for bfloat16 (nor for the float8 kinds): torch cannot hand such a
tensor over as a NumPy array at all, and TensorFlow hands an ml_dtypes array, which safetensors'
NumPy reader cannot read back unless ml_dtypes happens to be imported. So such an array travels
as RawBits -- its bits as an unsigned integer array of the same item size, and the dtype's name
-- and is stored so: the bits (U16 for bfloat16) in the file, the name in the file's metadata
under "hybridsync.dtypes" ({key: name}). Reading gives RawBits back for those keys; each
frontend turns them into its own dtype. This module (the core) imports neither torch nor
ml_dtypes.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

DTYPES_KEY = "hybridsync.dtypes"


class RawBits(NamedTuple):
    """An array of a dtype NumPy lacks: `bits` (uint8/16/32/64 of the same item size and shape)
    and `dtype`, the dtype's name ('bfloat16', 'float8_e4m3fn', ...)."""

    bits: np.ndarray
    dtype: str

    @property
    def shape(self) -> tuple:
        return self.bits.shape


def _unsigned(itemsize: int) -> np.dtype:
    return np.dtype(f"u{itemsize}")


def storable(value) -> np.ndarray | RawBits:
    """`value` as what write() stores: a NumPy array, or RawBits for an array of a dtype that
    a library registered with NumPy (ml_dtypes' bfloat16: kind 'V', no fields)."""
    if isinstance(value, RawBits):
        return value
    array = np.asarray(value)
    if array.dtype.kind == "V" and array.dtype.names is None:
        return RawBits(np.ascontiguousarray(array).view(_unsigned(array.dtype.itemsize)), array.dtype.name)
    return array


def write(arrays: dict, path: Path) -> None:
    """Writes `arrays` ({key: NumPy array or RawBits}) to the safetensors file `path` and
    flushes it to disk."""
    plain, dtypes = {}, {}
    for key, value in arrays.items():
        value = storable(value)
        if isinstance(value, RawBits):
            plain[key], dtypes[key] = np.ascontiguousarray(value.bits), value.dtype
        else:
            plain[key] = np.asarray(value, order="C")  # 0-d stays 0-d
    save_file(plain, str(path), metadata={DTYPES_KEY: json.dumps(dtypes)} if dtypes else None)
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def read(path: Path) -> dict:
    """What write() wrote: {key: NumPy array, or RawBits where the file records a dtype}."""
    with safe_open(str(path), framework="numpy") as f:
        dtypes = json.loads((f.metadata() or {}).get(DTYPES_KEY, "{}"))
        arrays = {key: f.get_tensor(key) for key in f.keys()}
    for key, name in dtypes.items():
        if key in arrays:
            arrays[key] = RawBits(arrays[key], name)
    return arrays
