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

import hashlib
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


_SAFETENSORS_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.int64): "I64", np.dtype(np.uint16): "U16",
                       np.dtype(np.float64): "F64", np.dtype(np.int32): "I32", np.dtype(np.uint32): "U32"}


class StreamedWriter:
    """A safetensors file written a chunk at a time, for arrays too large to hold: every array's
    key, dtype and shape are declared up front (the header comes first), then each array's rows
    arrive in order through write(). Memory: one chunk. The SHA-256 of the file is computed as
    it is written; close() checks every declared row arrived and flushes the file to disk. The
    file reads back with read() or safe_open like any other."""

    def __init__(self, path: Path, layout: list):
        """layout: [(key, dtype, shape)], in the order the arrays will be written."""
        self.path = Path(path)
        header, offset = {}, 0
        self._pending = []  # (key, dtype, bytes still to come)
        for key, dtype, shape in layout:
            dtype = np.dtype(dtype)
            size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            header[key] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": [int(d) for d in shape],
                           "data_offsets": [offset, offset + size]}
            self._pending.append((key, dtype, size))
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # (the data starts 8-aligned, as safetensors writes it)
        self._digest = hashlib.sha256()
        self._file = open(self.path, "wb")
        self._put(len(text).to_bytes(8, "little") + text)
        self.largest_chunk = 0  # bytes of the largest chunk handed over (what the writer held at once)

    def _put(self, data) -> None:
        self._file.write(data)
        self._digest.update(data)

    def write(self, key: str, chunk) -> None:
        """The next rows of array `key` (the one being written, in declaration order)."""
        if not self._pending or self._pending[0][0] != key:
            expected = self._pending[0][0] if self._pending else "nothing"
            raise ValueError(f"{self.path}: got rows of '{key}', expected {expected!r}")
        _, dtype, left = self._pending[0]
        data = np.ascontiguousarray(chunk, dtype=dtype)
        if data.nbytes > left:
            raise ValueError(f"{self.path}: '{key}' got more rows than declared")
        self.largest_chunk = max(self.largest_chunk, data.nbytes)
        self._put(memoryview(data).cast("B"))
        self._pending[0] = (key, dtype, left - data.nbytes)
        while self._pending and self._pending[0][2] == 0:
            self._pending.pop(0)

    def close(self) -> str:
        """Finishes the file (every declared row must have come); returns its SHA-256."""
        try:
            for key, _, left in self._pending:
                if left:
                    raise ValueError(f"{self.path}: '{key}' is {left} bytes short of its declared shape")
            self._file.flush()
            os.fsync(self._file.fileno())
        finally:
            self._file.close()
        return self._digest.hexdigest()

    def abandon(self) -> None:
        """Closes and removes an unfinished file."""
        self._file.close()
        self.path.unlink(missing_ok=True)
