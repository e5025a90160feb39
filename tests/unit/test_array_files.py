"""Checkpoint files keep every dtype bit for bit: arrays NumPy has a type for as they are,
bfloat16 (and the float8 kinds) as raw bits with the dtype's name in the file's metadata -- read
back without ml_dtypes, and an ml_dtypes array (what TensorFlow hands over) stored the same way."""
import json
import subprocess
import sys

import numpy as np

from hybridsync.array_files import RawBits, read, storable, write


def test_every_dtype_round_trips_bit_for_bit(tmp_path):
    arrays = {"f16": np.array([1.5, -0.0, np.inf], np.float16), "f64": np.array([[1e-300]]),
              "step": np.array(7, np.int64), "flag": np.array([True, False]), "u8": np.arange(3, dtype=np.uint8),
              "bf16": RawBits(np.array([0x3FC0, 0x7FC1], np.uint16), "bfloat16")}
    write(arrays, tmp_path / "a.safetensors")
    back = read(tmp_path / "a.safetensors")
    assert set(back) == set(arrays)
    for key in ("f16", "f64", "step", "flag", "u8"):
        assert back[key].dtype == arrays[key].dtype and back[key].shape == arrays[key].shape, key
        assert back[key].tobytes() == arrays[key].tobytes(), key
    assert isinstance(back["bf16"], RawBits) and back["bf16"].dtype == "bfloat16"
    assert back["bf16"].bits.dtype == np.uint16 and back["bf16"].bits.tolist() == [0x3FC0, 0x7FC1]


def test_an_ml_dtypes_array_is_stored_as_raw_bits_and_read_without_ml_dtypes(tmp_path):
    import ml_dtypes

    values = np.array([1.0, -2.5, 3.0e38], ml_dtypes.bfloat16)
    stored = storable(values)
    assert isinstance(stored, RawBits) and stored.dtype == "bfloat16" and stored.shape == (3,)
    write({"w": values}, tmp_path / "b.safetensors")
    # A process that never imports ml_dtypes (a PyTorch job) reads it.
    code = ("import json, sys; from hybridsync.array_files import read; r = read(sys.argv[1])['w']; "
            "assert 'ml_dtypes' not in sys.modules; print(json.dumps([r.dtype, r.bits.tolist()]))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "b.safetensors")], capture_output=True,
                         text=True, check=True).stdout
    assert json.loads(out) == ["bfloat16", values.view(np.uint16).tolist()]
