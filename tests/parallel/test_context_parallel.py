import pytest
import torch

from hapo_megatron.parallel.context_parallel import (
    cp_chunk_indices,
    cp_padded_length,
    gather_from_cp,
    split_for_cp,
)


def _loop_layout(seq_len, cp_size, cp_rank):
    """Megatron's layout written out: 2*cp chunks, rank r holds chunks r and 2cp-1-r."""
    chunk = seq_len // (2 * cp_size)
    out = []
    for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
        out += list(range(c * chunk, (c + 1) * chunk))
    return out


def test_hand_computed_cp2():
    # 8 positions, cp=2 -> chunks of 2: rank0 {0,1,6,7}, rank1 {2,3,4,5}
    assert cp_chunk_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_chunk_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert cp_chunk_indices(5, 1, 0).tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_layout_matches_loop_and_partitions(cp_size):
    seq_len = 2 * cp_size * 3
    seen = []
    for r in range(cp_size):
        idx = cp_chunk_indices(seq_len, cp_size, r).tolist()
        assert idx == _loop_layout(seq_len, cp_size, r)
        seen += idx
    assert sorted(seen) == list(range(seq_len))


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_split_gather_roundtrip(cp_size, dim):
    t = torch.randn(4 * cp_size, 8 * cp_size, 3)
    if dim == -1:
        t = torch.randn(2, 3, 4 * cp_size)
    shards = [split_for_cp(t, cp_size, r, dim=dim) for r in range(cp_size)]
    for r, s in enumerate(shards):
        d = dim % t.dim()
        assert s.shape[d] == t.shape[d] // cp_size
        assert torch.equal(s, t.index_select(d, torch.tensor(_loop_layout(t.shape[d], cp_size, r))))
    assert torch.equal(gather_from_cp(shards, dim=dim), t)


def test_labels_shift_before_split():
    # the label of position t is token t+1; after the split each rank's labels still line up
    tokens = torch.arange(17)
    inputs, labels = tokens[:-1].unsqueeze(0), tokens[1:].unsqueeze(0)
    for r in range(2):
        i, l = split_for_cp(inputs, 2, r), split_for_cp(labels, 2, r)
        assert torch.equal(l, i + 1)


def test_bad_input():
    with pytest.raises(ValueError, match="seq_len"):
        cp_chunk_indices(6, 2, 0)
    with pytest.raises(ValueError, match="cp_rank"):
        cp_chunk_indices(8, 2, 2)
    with pytest.raises(ValueError, match="cp_size"):
        cp_chunk_indices(8, 0, 0)
    with pytest.raises(ValueError, match="shards"):
        gather_from_cp([])
    assert cp_padded_length(13, 2) == 16 and cp_padded_length(13, 1) == 13 and cp_padded_length(16, 4) == 16
