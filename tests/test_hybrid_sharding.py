"""Hybrid sharding (parallelism.dp_shard): ZeRO shards over dp_shard x cp ranks and all-reduces each shard across
the replicas. The groups follow the rule of docs/zero.md#hybrid-sharding; every stage trains the one-process model;
a checkpoint moves between hybrid, full sharding and one process; the bytes are the formula's; wrong configs are
refused with one line.

Tolerances are those of tests/test_zero.py and tests/test_moe.py (float32 reductions in another order: a shard
summed in its group, then across replicas, where one process sums once).
"""
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch.distributed as dist

from nanoexp.checkpoint.save import rank_file
from nanoexp.observe.console import hybrid_sharding_line
from nanoexp.parallel.context import ParallelContext
from nanoexp.parallel.layout import Layout
from nanoexp.plan.traffic import hybrid_sent_bytes
from nanoexp.checks import check_config
from nanoexp.runtime.trainer import Trainer
from nanoexp.verify.comm_counter import CommCounter
from tests.distributed import run_distributed
from tests.helpers import FAST, SLOW, compose_config, start_error, tiered, train
from tests.test_checkpoint import CONSTANT_LR
from tests.test_moe import AUX_ATOL, MOE, Z_ATOL, moe_curves
from tests.test_moe import GRAD_NORM_RTOL as MOE_GRAD_NORM_RTOL
from tests.test_parallel import FIRST_STEP_ATOL, LATER_STEP_ATOL, assert_same_steps
from tests.test_zero import STEPS, assert_same_curve

HYBRID = ["parallelism=dp4tp1pp1", "parallelism.dp_shard=2"]   # 2 replicas x shard groups of 2 ranks


# -- the groups ------------------------------------------------------------------------------------
def contexts(layout: Layout, monkeypatch) -> list[ParallelContext]:
    """Every rank's ParallelContext of `layout`, built without processes: a group is its list of global ranks."""
    rank = {"now": 0}
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank["now"])
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: layout.world_size)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "new_group", lambda ranks, **_: SimpleNamespace(ranks=list(ranks),
                                                                               group_name=str(list(ranks))))
    out = []
    for r in range(layout.world_size):
        rank["now"] = r
        out.append(ParallelContext(layout))
    return out


def ranks_of(axis) -> set[int]:
    return set(axis.group.ranks) if axis.group is not None else set()


@pytest.mark.parametrize("layout", [Layout(dp=8, ep=2, dp_shard=4), Layout(dp=4, cp=2, tp=2, dp_shard=2, ep=2),
                                    Layout(dp=4, ep=2, dp_shard=2), Layout(dp=2, cp=2, pp=2, dp_shard=1)],
                         ids=["dp8ep2-shard4", "dp4cp2tp2ep2-shard2", "dp4ep2-shard2", "dp2cp2pp2-shard1"])
def test_shard_and_replica_groups_split_the_ranks_holding_the_same_weights(layout, monkeypatch):
    """For every rank: the shard group times the replica group is the dp x cp group (the edp group for routed
    experts), the shard group lies in the rank's block of dp_shard·cp·tp consecutive ranks, a replica group holds
    one rank of each shard group at the same place, and the experts' shard group is inside the shard group."""
    ctxs = contexts(layout, monkeypatch)
    for ctx in ctxs:
        for expert in (False, True) if layout.ep > 1 else (False,):
            shard, replica = ctx.zero_axes(expert)
            shard_ranks, replica_ranks = ranks_of(shard) or {ctx.rank}, ranks_of(replica)
            same_weights = set((ctx.edp_group if expert else ctx.dp_cp_group).ranks)
            assert (len(shard_ranks), len(replica_ranks)) == (shard.size, replica.size)
            assert replica.size == layout.replicas and replica.rank == ctx.replica_index
            assert shard_ranks & replica_ranks == {ctx.rank} and (shard_ranks | replica_ranks) <= same_weights
            assert shard.size * replica.size == len(same_weights)
            assert shard_ranks <= set(next(b for b in layout.shard_blocks() if ctx.rank in b))
            assert shard_ranks <= (ranks_of(ctx.zero_axes(False)[0]) or {ctx.rank})   # experts: inside it
            assert sorted(ctxs[r].replica_index for r in replica_ranks) == list(range(layout.replicas))
            place = "expert_shard_rank" if expert else "shard_rank"
            assert {getattr(ctxs[r], place) for r in replica_ranks} == {getattr(ctx, place)}
            assert sorted(getattr(ctxs[r], place) for r in shard_ranks) == list(range(shard.size))


def test_a_shard_group_inside_a_node_is_said_so():
    layout = Layout(dp=4, tp=2, dp_shard=2)   # shard groups in blocks of 4 consecutive ranks
    assert [list(b) for b in layout.shard_blocks()] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert not layout.shard_groups_cross_nodes(4) and not layout.shard_groups_cross_nodes(8)
    assert layout.shard_groups_cross_nodes(2) and layout.shard_groups_cross_nodes(6)
    line = hybrid_sharding_line(layout, 3, 8)   # the start-up line
    assert "shard groups of 2 ranks (dp_shard 2 x cp 1), 2 replicas" in line
    assert "ranks 0-3, 4-7 (one group per tp rank in each), each inside a node of 8 ranks" in line
    assert "some cross nodes of 2 ranks" in hybrid_sharding_line(layout, 3, 2)


# -- every stage trains the one-process model --------------------------------------------------------
@pytest.fixture
def reference(train_once):
    """One process (trained once per test session, shared with tests/test_zero.py)."""
    return lambda model: train_once(FAST + STEPS + model)[1]


LAYOUTS = {   # <= 4 processes: dp4 as 2 x 2; a shard group of the cp ranks; shard groups of one rank (all replicas)
    "dp4-2x2-zero1": HYBRID + ["optimizer.zero_stage=1"],
    "dp4-2x2-zero2": HYBRID + ["optimizer.zero_stage=2"],
    "dp4-2x2-zero3": HYBRID + ["optimizer.zero_stage=3"],
    "dp2cp2-shard1-zero3": ["parallelism=dp2cp2tp1pp1", "parallelism.dp_shard=1", "optimizer.zero_stage=3"],
    "dp2tp2-shard1-zero2": ["parallelism=dp2tp2pp1", "parallelism.dp_shard=1", "optimizer.zero_stage=2"],
    "dp2pp2-shard1-zero1": ["parallelism=dp2tp1pp2", "parallelism.dp_shard=1", "optimizer.zero_stage=1"],
}


@pytest.mark.parametrize("name", tiered(LAYOUTS, quick=["dp4-2x2-zero3"]))
def test_hybrid_sharding_reproduces_single_process_losses(name, reference, tmp_path):
    assert_same_curve(train(tmp_path, FAST + STEPS + LAYOUTS[name]), reference([]))


@SLOW
def test_hybrid_sharding_with_tensor_parallelism_on_8_ranks(reference, tmp_path):
    """dp4 as 2 replicas x 2 shards with tp2 (8 processes, the one such case): the shard groups of each tp rank."""
    overrides = ["parallelism=dp4tp2pp1", "parallelism.dp_shard=2", "optimizer.zero_stage=3"]
    assert_same_curve(train(tmp_path, FAST + STEPS + overrides), reference([]))


@SLOW
def test_routed_experts_shard_inside_the_shard_group(train_once, tmp_path):
    """dp4 ep2 as 2 x 2: the dense weights shard over 2 ranks and all-reduce across 2 replicas; the experts' shard
    group (the edp ranks inside a shard group) is one rank, so they stay whole and all-reduce over edp."""
    ours = moe_curves(train(tmp_path, FAST + MOE + STEPS + HYBRID + ["parallelism.ep=2", "optimizer.zero_stage=3"]))
    expected = moe_curves(train_once(FAST + MOE + STEPS)[1])
    assert len(ours["loss"]) == 8
    assert abs(ours["loss"][0] - expected["loss"][0]) < FIRST_STEP_ATOL
    np.testing.assert_allclose(ours["loss"], expected["loss"], atol=LATER_STEP_ATOL, rtol=0)
    np.testing.assert_allclose(ours["grad_norm"], expected["grad_norm"], rtol=MOE_GRAD_NORM_RTOL)
    np.testing.assert_allclose(ours["moe_aux_loss"], expected["moe_aux_loss"], atol=AUX_ATOL, rtol=0)
    np.testing.assert_allclose(ours["moe_z_loss"], expected["moe_z_loss"], atol=Z_ATOL, rtol=0)


# -- checkpoints ------------------------------------------------------------------------------------
def zero_pieces(checkpoint) -> dict[int, list]:
    """{rank: [(name, kind, tp_rank, flat range)]} of the ZeRO pieces each rank's file holds."""
    with open(os.path.join(checkpoint, "meta.json")) as f:
        meta = json.load(f)
    return {rank: [(e["name"], e["kind"], e["tp_rank"], tuple(e["flat_range"]))
                   for key, e in meta["index"].get(rank_file(rank), {}).items() if "@" in key]
            for rank in range(len(meta["files"]))}


@SLOW
def test_checkpoints_move_between_hybrid_full_and_one_process(tmp_path, train_once):
    """Saved by hybrid ZeRO-3 (2 x 2), resumed on one process, saved, resumed by full ZeRO-2 (dp4), saved,
    resumed by hybrid ZeRO-1 (2 x 2): the curve stays the one-process run's. Only replica 0 writes the pieces."""
    reference = train_once(CONSTANT_LR + ["tokens.train_steps=8"])[1]
    a = train(tmp_path / "a", CONSTANT_LR + HYBRID + ["optimizer.zero_stage=3", "tokens.train_steps=2"])
    b = train(tmp_path / "b", CONSTANT_LR + ["tokens.train_steps=4",
                                             f"checkpoint.resume_checkpoint_path={tmp_path}/a/checkpoints/2"])
    c = train(tmp_path / "c", CONSTANT_LR + ["parallelism=dp4tp1pp1", "optimizer.zero_stage=2", "tokens.train_steps=6",
                                             f"checkpoint.resume_checkpoint_path={tmp_path}/b/checkpoints/4"])
    d = train(tmp_path / "d", CONSTANT_LR + HYBRID + ["optimizer.zero_stage=1", "tokens.train_steps=8",
                                                      f"checkpoint.resume_checkpoint_path={tmp_path}/c/checkpoints/6"])
    assert_same_steps(a + b + c + d, reference, steps=range(1, 9))   # losses and gradient norms
    pieces = zero_pieces(tmp_path / "a" / "checkpoints" / "2")
    assert pieces[0] and pieces[1] and not pieces[2] and not pieces[3]   # ranks 2, 3: replica 1


# -- the bytes ---------------------------------------------------------------------------------------
def _counted_step(rank, world_size, overrides):
    """The second of two steps under a CommCounter over the shard, replica and dp x cp groups."""
    cfg = compose_config(FAST + overrides)
    check_config(cfg, world_size)
    ctx = ParallelContext(Layout.from_config(cfg))
    trainer = Trainer(cfg, ctx, run_dir=os.devnull)
    trainer.train_step(trainer.batches.next_step(), 1e-3)
    groups = {"shard": ctx.shard_group, "replica": ctx.replica_group} if ctx.replicas > 1 else {
        "shard": ctx.dp_cp_group}
    with CommCounter(groups) as comm:
        trainer.train_step(trainer.batches.next_step(), 1e-3)
    trainer.batches.close()
    held = sum(p.numel() for p in trainer.model.parameters())
    return {"totals": comm.totals(), "held": held, "micro_batches": trainer.accumulation}


@pytest.mark.parametrize("stage", [1, 3])
def test_counted_bytes_are_the_formulas(stage):
    """dp4 as 2 x 2: what each rank sends over its shard group and its replica group equals the formula, within
    0.1 % (the units are padded to a multiple of the shard group's ranks, at most n-1 floats each; measured: equal
    to the byte). The shard group's bytes are full sharding's over 2 ranks; the replicas move each shard once a step."""
    overrides = HYBRID + [f"optimizer.zero_stage={stage}"]
    cfg, layout = compose_config(FAST + overrides), Layout(dp=4, dp_shard=2)
    for r in run_distributed(_counted_step, 4, overrides):
        formula = hybrid_sent_bytes(cfg, layout, r["held"], r["micro_batches"])
        for group in ("shard", "replica"):
            sent = r["totals"][group]["sent_bytes"]
            assert abs(sent - formula[group]) / formula[group] < 1e-3, (group, sent, formula[group])


# -- wrong configs -----------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (["parallelism=dp4tp1pp1", "parallelism.dp_shard=3", "optimizer.zero_stage=1"],
     "parallelism.dp_shard=3 does not divide parallelism.dp=4"),
    (["parallelism=dp4tp1pp1", "parallelism.dp_shard=2", "optimizer.zero_stage=0"],
     "parallelism.dp_shard=2 has no effect at optimizer.zero_stage=0"),
    (MOE + ["parallelism=dp4tp1pp1", "parallelism.dp_shard=1", "parallelism.ep=2", "optimizer.zero_stage=1"],
     "parallelism.dp_shard=1 with parallelism.ep=2: ep must divide dp_shard * cp = 1"),
    (["parallelism=dp4tp1pp1", "parallelism.dp_shard=2", "optimizer.zero_stage=1",
      "optimizer.optimizer_factory.name=muon"], "parallelism.dp_shard=2: Muon gathers its matrices"),
    (["parallelism=dp4tp1pp1", "parallelism.dp_shard=0", "optimizer.zero_stage=1"], "parallelism.dp_shard=0"),
], ids=["not-dividing", "zero0", "ep-outside", "muon", "zero"])
def test_wrong_hybrid_config_is_named(overrides, message):
    error = start_error(compose_config(FAST + overrides))
    assert message in error and "\n" not in error, error
