"""Sharding is pure logic: samplers for every rank are built in one process."""

import pytest
import torch.utils.data

from dptrain import DistributedSampler


def _shards(n, world, **kwargs):
    return [list(DistributedSampler(n, num_replicas=world, rank=r, **kwargs)) for r in range(world)]


@pytest.mark.parametrize("n,world", [(12, 3), (10, 4), (7, 2), (5, 5), (3, 4)])
def test_shards_are_disjoint_and_cover_the_dataset(n, world):
    shards = _shards(n, world, drop_last=False, seed=3)
    assert len({len(s) for s in shards}) == 1
    flat = [i for s in shards for i in s]
    assert set(flat) == set(range(n))
    assert len(flat) - n == (-n) % world  # the padding: that many samples seen twice


@pytest.mark.parametrize("n,world", [(12, 3), (10, 4), (7, 2)])
def test_drop_last_drops_the_tail_and_never_repeats(n, world):
    shards = _shards(n, world, drop_last=True)
    flat = [i for s in shards for i in s]
    assert len(flat) == len(set(flat)) == (n // world) * world


def test_every_rank_computes_the_same_permutation_and_epochs_differ():
    samplers = [DistributedSampler(50, num_replicas=3, rank=r, seed=7) for r in range(3)]
    assert len({tuple(s.permutation()) for s in samplers}) == 1
    first = samplers[0].permutation()
    samplers[0].set_epoch(1)
    assert samplers[0].permutation() != first and sorted(samplers[0].permutation()[:50]) == list(range(50))


@pytest.mark.parametrize("n,world,drop_last,shuffle", [(13, 4, False, True), (13, 4, True, True),
                                                       (9, 3, False, False)])
def test_same_indices_as_torchs_distributed_sampler(n, world, drop_last, shuffle):
    data = list(range(n))
    for rank in range(world):
        ours = DistributedSampler(n, num_replicas=world, rank=rank, drop_last=drop_last, shuffle=shuffle, seed=5)
        theirs = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank, drop_last=drop_last,
                                                     shuffle=shuffle, seed=5)
        ours.set_epoch(2)
        theirs.set_epoch(2)
        assert list(ours) == list(theirs) and len(ours) == len(theirs)


@pytest.mark.parametrize("old_world,new_world,per_rank_done", [(4, 2, 2), (2, 3, 3), (3, 1, 2), (3, 2, 2)])
def test_resuming_on_another_world_size_skips_nothing_and_repeats_nothing(old_world, new_world, per_rank_done):
    # Consumed = old_world x per_rank_done: a multiple of both world sizes, as a global
    # batch that fits both is.
    n = 24
    consumed = [i for s in _shards(n, old_world, seed=1) for i in s[:per_rank_done]]
    start = per_rank_done * old_world
    rest, lengths = [], set()
    for rank in range(new_world):
        sampler = DistributedSampler(n, num_replicas=new_world, rank=rank, seed=1)
        sampler.set_epoch(0, start=start)
        assert len(sampler) == len(list(sampler))
        lengths.add(len(sampler))
        rest += list(sampler)
    assert sorted(consumed + rest) == list(range(n))
    assert len(lengths) == 1, "every rank must get as many samples as the others, or a loop hangs"


def test_bad_arguments_are_explained():
    with pytest.raises(ValueError, match=r"rank 3 is not in \[0, 3\)"):
        DistributedSampler(10, num_replicas=3, rank=3)
    with pytest.raises(ValueError, match="leaves every rank empty"):
        DistributedSampler(2, num_replicas=4, rank=0, drop_last=True)
    with pytest.raises(ValueError, match="start 99 is outside"):
        DistributedSampler(10, num_replicas=2, rank=0).set_epoch(0, start=99)
    with pytest.raises(ValueError, match="start 8 is not a multiple of num_replicas 3.*e.g. 6"):
        DistributedSampler(24, num_replicas=3, rank=0).set_epoch(0, start=8)
