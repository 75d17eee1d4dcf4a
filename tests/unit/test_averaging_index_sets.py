"""SPARTA index sets [report 5.7]: identical in every process for the same seed and round, and
tiling the parameters exactly once per `segments` rounds; the flat layout they index."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from roles.worker.averaging.index_sets import FeistelPermutation, SegmentIndexSets
from roles.worker.layout import FlatLayout

LAYOUTS = {
    "one tensor": (["w"], [(1000,)]),
    "several": (["a", "b", "c"], [(17, 3), (1,), (250,)]),
    "tiny": (["x"], [(3,)]),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("segments", [1, 4, 7, 20])
def test_segments_tile_the_parameters_exactly_once_per_pass(name, segments):
    layout = FlatLayout(*LAYOUTS[name])
    sets = SegmentIndexSets(layout, segments, seed=5, stage=1)
    seen = torch.cat([sets.get(s).indices for s in range(segments)])
    assert torch.equal(torch.sort(seen).values, torch.arange(layout.numel)), "each index exactly once per pass"
    sizes = [len(sets.get(s)) for s in range(segments)]
    assert max(sizes) <= sets.buffer_size and max(sizes) - min(sizes) <= 1
    for s in range(segments):
        indices = sets.get(s).indices
        assert torch.equal(indices, torch.sort(indices).values), "sets are sorted for fast gathers"


def test_sets_are_random_not_contiguous_and_depend_on_seed_stage_and_layout():
    layout = FlatLayout(["w"], [(10_000,)])
    base = SegmentIndexSets(layout, 20, seed=0, stage=0).get(3)
    assert base.indices.diff().max() > 1 and int(base.indices[0]) < 2_000, "spread over the whole vector"
    others = [
        SegmentIndexSets(layout, 20, seed=1, stage=0).get(3),
        SegmentIndexSets(layout, 20, seed=0, stage=1).get(3),
        SegmentIndexSets(FlatLayout(["v"], [(10_000,)]), 20, seed=0, stage=0).get(3),
    ]
    for other in others:
        assert other.digest != base.digest
        assert not torch.equal(other.indices, base.indices)


def _compute(args):
    names, shapes, segments, seed, stage, segment = args
    sets = SegmentIndexSets(FlatLayout(names, shapes), segments, seed=seed, stage=stage)
    index_set = sets.get(segment)
    return index_set.digest, index_set.indices.tolist()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_index_sets_are_identical_across_processes(method):
    names, shapes = LAYOUTS["several"]
    jobs = [(names, shapes, 4, 11, 2, segment) for segment in range(4)]
    local = [_compute(job) for job in jobs]
    with mp.get_context(method).Pool(1) as pool:
        remote = pool.map(_compute, jobs)
    assert remote == local


def test_feistel_is_a_bijection_for_awkward_sizes():
    for n in (1, 2, 3, 5, 8, 1023, 1025, 65_537):
        permutation = FeistelPermutation(n, b"key")
        image = permutation(torch.arange(n))
        assert torch.equal(torch.sort(image).values, torch.arange(n)), n


def test_layout_gathers_adds_reads_and_writes_across_tensors():
    layout = FlatLayout(["a", "b"], [(2, 3), (4,)])
    tensors = [torch.arange(6, dtype=torch.float32).view(2, 3), torch.arange(6, 10, dtype=torch.float32)]
    indices = torch.tensor([1, 5, 6, 9])
    pieces = layout.split(indices)
    out = torch.empty(4)
    layout.gather(tensors, pieces, out)
    assert out.tolist() == [1, 5, 6, 9]
    layout.add_(tensors, pieces, torch.tensor([10.0, 20.0, 30.0, 40.0]))
    assert layout.read(tensors, 0, 10).tolist() == [0, 11, 2, 3, 4, 25, 36, 7, 8, 49]
    layout.write(tensors, 4, torch.tensor([-1.0, -2.0, -3.0]))
    assert tensors[0].view(-1).tolist()[4:] == [-1, -2] and tensors[1][0] == -3
    with pytest.raises(ValueError):
        layout.read(tensors, 8, 3)


def test_layout_digest_covers_names_and_shapes():
    assert FlatLayout(["a"], [(4,)]).digest == FlatLayout(["a"], [(4,)]).digest
    assert FlatLayout(["a"], [(4,)]).digest != FlatLayout(["b"], [(4,)]).digest
    assert FlatLayout(["a"], [(4,)]).digest != FlatLayout(["a"], [(2, 2)]).digest
