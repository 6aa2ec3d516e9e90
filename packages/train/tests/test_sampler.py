"""Sample order per data-parallel rank, and resuming from consumed samples."""

import itertools

from mega.train.sampler import cyclic_indices, single_pass_indices


def test_single_pass_cuts_each_window_by_rank():
    ranks = [list(single_pass_indices(20, 0, 2, rank, 3)) for rank in range(3)]
    assert ranks[0][:2] == [[0, 1], [6, 7]]
    assert ranks[1][:2] == [[2, 3], [8, 9]]
    assert ranks[2][:2] == [[4, 5], [10, 11]]
    # 20 samples hold three whole windows of 6; the rest is not read.
    assert all(len(batches) == 3 for batches in ranks)
    assert sorted(i for batches in ranks for b in batches for i in b) == list(range(18))


def test_single_pass_resumes_where_it_stopped():
    full = list(single_pass_indices(40, 0, 2, 1, 2))
    resumed = list(single_pass_indices(40, 12, 2, 1, 2))
    assert resumed == full[3:]


def test_cyclic_is_a_permutation_per_epoch_split_into_rank_buckets():
    epoch = [list(itertools.islice(cyclic_indices(24, 0, 2, rank, 3, seed=7), 4)) for rank in range(3)]
    flat = sorted(i for batches in epoch for b in batches for i in b)
    assert flat == list(range(24))
    assert all(0 <= i < 8 for b in epoch[0] for i in b) and all(16 <= i < 24 for b in epoch[2] for i in b)
    # The next epoch is a different permutation.
    stream = list(itertools.islice(cyclic_indices(24, 0, 2, 0, 3, seed=7), 8))
    assert stream[:4] != stream[4:] and sorted(sum(stream[4:], [])) == list(range(8))


def test_cyclic_resume_matches_the_uninterrupted_stream():
    full = list(itertools.islice(cyclic_indices(24, 0, 2, 1, 3, seed=3), 10))
    resumed = list(itertools.islice(cyclic_indices(24, 18, 2, 1, 3, seed=3), 7))
    assert resumed == full[3:]
