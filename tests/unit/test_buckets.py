"""Fusion of the optimizer's all-reduces: small gradients share a bucket, a large one is
reduced where it is (a fused copy of large gradients would hold them twice)."""
import numpy as np

from hybridsync.comm.buckets import ALONE_BYTES, make_buckets

KEY = ("average", (1.0, 1.0))


def test_small_arrays_share_a_bucket_and_a_large_one_is_reduced_in_place():
    small_a, small_b = np.ones(256, np.float32), np.full(100, 2.0, np.float32)
    large = np.zeros(ALONE_BYTES // 4 + 1, np.float32)  # a densified embedding gradient, say
    buckets = make_buckets([small_a, large, small_b], [KEY] * 3, limit_bytes=64 << 20)
    fused = [b for b in buckets if len(b.arrays) > 1]
    alone = [b for b in buckets if b.arrays[0] is large]
    assert len(buckets) == 2 and len(fused) == 1 and len(alone) == 1
    assert fused[0].arrays == [small_a, small_b]
    assert np.shares_memory(alone[0].flat, large)  # no copy: the reduction lands in the gradient
    fused[0].flat[:] *= 3
    fused[0].scatter_back()
    assert small_a[0] == 3 and small_b[-1] == 6


def test_the_layout_is_the_same_for_the_same_shapes_and_keys():
    # (every rank builds the buckets from its own arrays: same shapes and keys, same layout)
    def layout(seed):
        rng = np.random.default_rng(seed)
        arrays = [rng.standard_normal(n).astype(np.float32) for n in (10, 2_000_000, 30, 5, 1_500_000)]
        keys = [KEY, KEY, ("sum", (1.0, 1.0)), KEY, KEY]
        return [[a.shape for a in b.arrays] + [b.key] for b in make_buckets(arrays, keys, 64 << 20)]

    assert layout(1) == layout(2)


def test_a_fusion_limit_below_the_large_size_keeps_arrays_over_it_alone():
    arrays = [np.zeros(300, np.float32), np.zeros(300, np.float32)]  # 1200 bytes each
    buckets = make_buckets(arrays, [KEY] * 2, limit_bytes=1000)
    assert [len(b.arrays) for b in buckets] == [1, 1]
    assert all(np.shares_memory(b.flat, a) for b, a in zip(buckets, arrays))
