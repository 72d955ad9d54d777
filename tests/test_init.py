"""Initial weights (nanoexp/model/init.py): the same model on every layout, each rank drawing only what it keeps."""
import pytest
import torch

import nanoexp.model.init as init
from nanoexp.runtime.build import build_model
from nanoexp.parallel.context import ParallelContext
from nanoexp.parallel.layout import Layout
from nanoexp.model.placement import placement
from tests.distributed import run_distributed
from tests.helpers import FAST, compose_config


def normal_slice(shape, dim, lo, hi, seed=42, name="w"):
    out = torch.empty(*[hi - lo if d == dim else size for d, size in enumerate(shape)])
    init.fill_normal(out, dim, lo, shape[dim], 0.5, seed, name)
    return out


@pytest.mark.parametrize("shape, dim", [((130, 7), 0), ((5, 200), 1), ((64, 3), 0)])
def test_a_slice_is_the_same_values_as_in_the_whole_tensor(shape, dim):
    whole = normal_slice(shape, dim, 0, shape[dim])
    assert whole.shape == shape and whole.std().item() == pytest.approx(0.5, rel=0.2)
    for lo, hi in [(0, 1), (3, min(70, shape[dim])), (63, min(65, shape[dim])), (shape[dim] - 2, shape[dim])]:
        assert torch.equal(normal_slice(shape, dim, lo, hi), whole.narrow(dim, lo, hi - lo))
    assert not torch.equal(whole, normal_slice(shape, dim, 0, shape[dim], seed=43))   # the seed counts
    assert not torch.equal(whole, normal_slice(shape, dim, 0, shape[dim], name="v"))   # and the name


def build_and_count(layout: Layout, overrides: list[str]) -> tuple[dict, int, int]:
    """This rank's parameters (name -> (tensor, split dim)), the elements its init drew and the model's total,
    with slabs of 4 indices so that a shard's draws are close to its size."""
    drawn = [0]
    draw, slab = init.draw_slab, init.SLAB

    def counting(shape, std, generator):
        drawn[0] += torch.Size(shape).numel()
        return draw(shape, std, generator)

    init.draw_slab, init.SLAB = counting, 4
    try:
        model = build_model(compose_config(FAST + overrides), ParallelContext(layout))
    finally:
        init.draw_slab, init.SLAB = draw, slab
    params = {name: (p.detach().clone(), placement(p).split_dim) for name, p in model.named_parameters()}
    matrices = sum(p.numel() for name, p in model.named_parameters() if not name.endswith("norm.weight"))
    return params, drawn[0], matrices


MHA = ["model.model_config.num_key_value_heads=4"]   # 4 KV heads: tp 4 splits them


def _tp4(rank, world_size):
    return build_and_count(Layout(tp=4), MHA + ["parallelism.tp=4"])


def test_every_layout_draws_the_same_model_and_each_rank_only_its_shard():
    whole, drawn_whole, matrices_whole = build_and_count(Layout(), MHA)
    assert drawn_whole == matrices_whole   # one process draws every element once
    ranks = run_distributed(_tp4, 4)
    for name, (tensor, dim) in whole.items():
        parts = [torch.as_tensor(r[0][name][0]) for r in ranks]
        stitched = parts[0] if dim is None else torch.cat(parts, dim)
        assert torch.equal(stitched, tensor), name
    for _, drawn, matrices in ranks:   # each matrix slice drawn once, plus at most a slab (4 indices) at each end
        assert matrices <= drawn <= 1.05 * matrices, (drawn, matrices)
