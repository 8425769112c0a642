"""Bucket assignment is pure logic: tested without any process group."""

import pytest
import torch

from dptrain.ddp.buckets import Bucket, ParamInfo, assign_buckets, ddp_bucket_layout

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


def test_last_bucket_takes_the_gradients_ready_last_up_to_its_cap():
    params = _params(*([2] * 8))  # 8 bytes each; ready order 7..0
    assert assign_buckets(params, cap_bytes=32, last_cap_bytes=16) == [[7, 6, 5, 4], [3, 2], [1, 0]]
    # like every bucket it closes once it reaches its cap: a large last parameter is a bucket alone
    assert assign_buckets(_params(100, 1, 1, 1), cap_bytes=1 << 20, last_cap_bytes=8) == [[3, 2, 1], [0]]


def test_last_bucket_and_first_bucket_caps_together():
    params = _params(*([2] * 8))
    # [2, 1] is what the cap leaves before the last bucket: 16 B, not under the 8 B last cap, so it stays
    assert assign_buckets(params, cap_bytes=32, first_cap_bytes=8, last_cap_bytes=8) == [[7], [6, 5, 4, 3], [2, 1],
                                                                                          [0]]


def test_a_small_leftover_joins_the_last_bucket_instead_of_paying_a_collective_of_its_own():
    # registration: weight (1000), bias (10), weight (1000); ready order 2, 1, 0. The weight ready last is the
    # last bucket; the bias left over before it (40 B < the 100 B last cap) joins it.
    params = _params(1000, 10, 1000)
    assert assign_buckets(params, cap_bytes=4000, last_cap_bytes=100) == [[2], [1, 0]]


def test_each_dtype_gets_its_own_last_bucket_and_none_is_lost():
    half, full = _params(4, dtype=torch.float16)[0], _params(4)[0]
    params = [full, half, full, half, full, half]
    buckets = assign_buckets(params, cap_bytes=1 << 20, last_cap_bytes=1)
    assert sorted(i for b in buckets for i in b) == list(range(6))
    assert [0] in buckets and [1] in buckets  # the last-ready parameter of each dtype alone
    assert all(len({params[i].dtype for i in b}) == 1 for b in buckets)


def test_the_ddp_layout_rule_is_torchs_without_the_last_bucket_option():
    params = _params(*([300_000] * 30))  # 1.2 MB each
    default = ddp_bucket_layout(params)
    assert default == assign_buckets(params, 25 * 2**20, 2**20)
    assert ddp_bucket_layout(params, 4.0) == assign_buckets(params, 4 * 2**20)
    with_last = ddp_bucket_layout(params, 4.0, last_bucket_cap_mb=1.0)
    assert with_last == assign_buckets(params, 4 * 2**20, order=range(29, 0, -1)) + [[0]]


def test_non_positive_last_cap_is_refused():
    with pytest.raises(ValueError, match="last bucket cap must be positive, got 0 bytes"):
        assign_buckets(_params(1), cap_bytes=8, last_cap_bytes=0)
