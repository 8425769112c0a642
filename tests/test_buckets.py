"""Bucket assignment is pure logic: tested without any process group."""

import pytest
import torch

from dptrain.ddp.buckets import Bucket, ParamInfo, assign_buckets

CPU = torch.device("cpu")


def _params(*numels, dtype=torch.float32):
    return [ParamInfo(n, torch.tensor([], dtype=dtype).element_size(), dtype, CPU) for n in numels]


def test_buckets_follow_reverse_registration_order_and_close_at_the_cap():
    # 4 bytes per element, cap 40 bytes = 10 elements; a bucket closes once it reaches the cap.
    params = _params(3, 4, 5, 6, 2)
    assert assign_buckets(params, cap_bytes=40) == [[4, 3, 2], [1, 0]]


def test_a_parameter_larger_than_the_cap_gets_a_bucket_of_its_own():
    assert assign_buckets(_params(100, 1, 1), cap_bytes=8) == [[2, 1], [0]]


def test_first_bucket_has_its_own_cap():
    params = _params(*([2] * 8))  # 8 bytes each
    assert assign_buckets(params, cap_bytes=32, first_cap_bytes=8) == [[7], [6, 5, 4, 3], [2, 1, 0]]


def test_dtypes_never_share_a_bucket_and_launch_order_follows_readiness():
    half, full = _params(4, dtype=torch.float16)[0], _params(4)[0]
    params = [full, half, full, half]  # ready order: 3 (half), 2 (full), 1 (half), 0 (full)
    buckets = assign_buckets(params, cap_bytes=1 << 20)
    assert sorted(map(sorted, buckets)) == [[0, 2], [1, 3]]
    assert buckets == [[3, 1], [2, 0]]  # the half bucket's last member (1) is ready before 0


def test_explicit_order_overrides_registration_order():
    assert assign_buckets(_params(1, 1, 1, 1), cap_bytes=8, order=[0, 2, 1, 3]) == [[0, 2], [1, 3]]


def test_every_parameter_lands_in_exactly_one_bucket():
    params = _params(*range(1, 40))
    buckets = assign_buckets(params, cap_bytes=64, first_cap_bytes=16)
    assert sorted(i for b in buckets for i in b) == list(range(39))


def test_non_positive_cap_is_refused():
    with pytest.raises(ValueError, match="bucket cap must be positive, got 0 bytes"):
        assign_buckets(_params(1), cap_bytes=0)


def test_bucket_views_tile_the_flat_buffer():
    params = [torch.nn.Parameter(torch.randn(2, 3)), torch.nn.Parameter(torch.randn(4))]
    bucket = Bucket(0, params, [0, 1])
    assert bucket.numel == 10 and bucket.nbytes == 40
    bucket.views[0].fill_(1.0)
    bucket.views[1].fill_(2.0)
    assert bucket.buffer.tolist() == [1.0] * 6 + [2.0] * 4
    assert [v.shape for v in bucket.views] == [p.shape for p in params]
