"""Tied embeddings split over the pipeline: the first stage's embedding and the last stage's copy (the LM head)
stay identical, bit for bit, whatever the layout. Each copy's gradient is averaged over dp x cp in its own
stage's buckets, then the two are summed over the embedding group: a sum of two numbers is the same on both
ends, so the copies cannot drift (summing first and averaging each copy in a different bucket layout could
round differently on the two stages)."""
import tempfile

import pytest
import torch

from nanoexp.parallel.context import ParallelContext
from nanoexp.parallel.layout import Layout
from nanoexp.checks import check_config
from nanoexp.runtime.trainer import Trainer
from tests.distributed import run_distributed
from tests.helpers import FAST, SLOW, compose_config
from tests.test_parallel import TIED

STEPS = ["tokens.train_steps=50", "tokens.val_check_interval=0", "checkpoint.save_final_state=false",
         "logging.iteration_step_info_interval=50"]


def _tied_copies(rank, world_size, overrides):
    cfg = compose_config(FAST + STEPS + TIED + overrides)
    check_config(cfg, world_size)
    ctx = ParallelContext(Layout.from_config(cfg))
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(cfg, ctx, run_dir)
        trainer.train()
    model = trainer.model
    copy = model.model.embed_tokens.weight if ctx.is_first_stage else model.lm_head.weight
    return {"pp": ctx.pp_rank, "dp": ctx.dp_rank, "tp": ctx.tp_rank, "weight": copy.detach().clone()}


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    pytest.param(["parallelism=dp4tp1pp2"], marks=SLOW),   # (sequence parallelism needs tp > 1: the next case)
    pytest.param(["parallelism=dp2tp2pp2", "parallelism.tp_mode=reduce_scatter"], marks=SLOW),
    ["parallelism=dp2tp1pp2", "optimizer.zero_stage=1"],
], ids=["dp4tp1pp2", "dp2tp2pp2-sp", "dp2tp1pp2-zero1"])
def test_the_two_copies_stay_identical(overrides):
    world = Layout.from_config(compose_config(FAST + overrides)).world_size
    results = run_distributed(_tied_copies, world, overrides)
    last = max(r["pp"] for r in results)
    embeddings = {(r["dp"], r["tp"]): r["weight"] for r in results if r["pp"] == 0}
    heads = {(r["dp"], r["tp"]): r["weight"] for r in results if r["pp"] == last}
    assert embeddings.keys() == heads.keys() and len(heads) == world // 2
    for position, embedding in embeddings.items():
        head = torch.as_tensor(heads[position])
        assert torch.equal(torch.as_tensor(embedding), head), (position, (torch.as_tensor(embedding) - head).abs().max())
