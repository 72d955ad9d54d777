"""ZeRO-2 and ZeRO-3: every stage trains the one-process model, a rank holds only what its stage promises,
communication is what the analytic count says, and checkpoints move between stages and layouts.

Tolerances are those of tests/test_parallel.py (float32 reductions in another order): each stage reduces
every micro-batch's gradients separately and sums the shards, one process sums the micro-batches first.
"""
import os

import pytest
import torch
from transformers import LlamaForCausalLM as HFLlama

from nanoexp.runtime.build import load_single_process
from nanoexp.parallel.context import ParallelContext
from nanoexp.parallel.gradient_sync import GradientSync
from nanoexp.parallel.layout import Layout
from nanoexp.checks import check_config
from nanoexp.runtime.trainer import Trainer
from nanoexp.verify.comm_counter import CommCounter
from nanoexp.interop.hf_checkpoint import convert_to_hf
from tests.distributed import run_distributed
from tests.helpers import FAST, SLOW, compose_config, tiered, train, train_losses
from tests.test_checkpoint import CONSTANT_LR
from tests.test_hf_conversion import LOGITS_ATOL
from tests.test_parallel import INTERLEAVED, MUP, TIED, _first_step, assert_same_curve as assert_same_parallel_curve, \
    assert_same_first_step, assert_same_steps

STEPS = ["tokens.train_steps=8", "tokens.val_check_interval=0", "optimizer.learning_rate_scheduler.learning_rate=1e-3",
         "optimizer.learning_rate_scheduler.lr_warmup_steps=2"]
# Five layouts, each under every stage. Measured over the 8 steps: the first step identical (cp: 4.8e-7), at
# most 4.8e-7 from one process after it (cp: 9.5e-7), at every stage alike.
LAYOUTS = {
    "dp2": ["parallelism=dp2tp1pp1"],
    "dp4": ["parallelism=dp4tp1pp1"],
    "dp2tp2": ["parallelism=dp2tp2pp1"],
    "dp2pp2-1f1b": ["parallelism=dp2tp1pp2"],
    "dp2cp2": ["parallelism=dp2cp2tp1pp1"],
}
# ZeRO-3 with the rest: parameters kept whole (sequence-parallel norms, embeddings tied across stages or on one
# stage), recomputation (a layer's forward re-run inside its backward), the schedules, the prefetch depth,
# layers kept gathered from forward to backward, µP.
COMPOSED = {
    "dp2tp2pp2-reduce_scatter-tied": (TIED, ["parallelism=dp2tp2pp2", "parallelism.tp_mode=reduce_scatter"]),
    "dp2-tied-one-stage": (TIED, ["parallelism=dp2tp1pp1"]),
    "dp2cp2-recompute-prefetch2": ([], ["parallelism=dp2cp2tp1pp1", "parallelism.recompute_layer=true",
                                        "optimizer.zero3_prefetch=2"]),
    "dp2pp2-interleaved-keep-gathered": ([], ["parallelism=dp2tp1pp2", "optimizer.zero3_reshard_after_forward=false"]
                                         + INTERLEAVED),
    "dp2pp2-afab-no-prefetch": ([], ["parallelism=dp2tp1pp2", "parallelism.pp_engine=afab",
                                     "optimizer.zero3_prefetch=0"]),
    "mup-dp2tp2": (MUP, ["parallelism=dp2tp2pp1"]),
    "dp2-overlap": ([], ["parallelism=dp2tp1pp1", "optimizer.zero_overlap_reduce_scatter=true"]),
}


@pytest.fixture
def reference(train_once):
    """One process (trained once per test session): the curves every stage and layout must reproduce."""
    return lambda model: train_once(FAST + STEPS + model)[1]


def assert_same_curve(records, expected_records):
    """Every step's loss and gradient norm and the final eval loss, to the tolerances of tests/test_parallel.py."""
    assert_same_parallel_curve(records, expected_records, steps=8)


QUICK_STAGES = [("dp2pp2-1f1b", 1), ("dp2cp2", 3)]   # the quick tier's share of the 20 cases


@pytest.mark.slow
@pytest.mark.parametrize("layout, stage", [
    pytest.param(layout, stage, id=f"{layout}-{stage}", marks=[] if (layout, stage) in QUICK_STAGES else [SLOW])
    for stage in [0, 1, 2, 3] for layout in LAYOUTS])
def test_zero_stage_reproduces_single_process_losses(layout, stage, reference, tmp_path):
    records = train(tmp_path, FAST + STEPS + LAYOUTS[layout] + [f"optimizer.zero_stage={stage}"])
    assert_same_curve(records, reference([]))


@pytest.mark.slow
@pytest.mark.parametrize("name", tiered(COMPOSED, quick=["dp2tp2pp2-reduce_scatter-tied"]))
def test_zero3_composes(name, reference, tmp_path):
    model, layout = COMPOSED[name]
    records = train(tmp_path, FAST + STEPS + model + layout + ["optimizer.zero_stage=3"])
    assert_same_curve(records, reference(model))


@pytest.fixture(scope="module")
def first_step():
    """One process's first step: loss and full gradients."""
    (expected,) = run_distributed(_first_step, 1, ["parallelism=dp1tp1pp1"])
    return expected


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_first_step_gradients_match_single_process(stage, first_step):
    """dp2 (2 micro-batches a rank): the shards of the averaged gradient that the ranks hold after one step, put
    together, are one process's gradient, to tests/test_parallel.py's tolerance of float32 rounding (1e-4 of each
    gradient's largest element; measured 1.2e-7 at every stage). A sum instead of a mean is 100 % off here, while
    the 8-step loss curve moves by less than its tolerance."""
    results = run_distributed(_first_step, 2, ["parallelism=dp2tp1pp1", f"optimizer.zero_stage={stage}"])
    assert all(r["sharded"] for r in results)
    assert_same_first_step(results, first_step)


# -- what a rank holds, and what it sends --------------------------------------------------------
def calls_by_kind(records, group: str) -> dict[str, tuple[int, int]]:
    """{all_gather | reduce_scatter | ...: (calls, this rank's payload bytes)} on `group`, whatever this torch
    names the calls."""
    calls = {}
    for where, name, payload, _sent in records:
        if where == group:
            kind = next((k for k in ("all_gather", "reduce_scatter") if name.startswith(k)), name)
            count, total = calls.get(kind, (0, 0))
            calls[kind] = (count + 1, total + payload)
    return calls


def _one_step(rank, world_size, overrides):
    """Two optimizer steps of dp2 (2 micro-batches each); what is held between and during them, and the bytes of
    the second step's collectives on the dp x cp group."""
    cfg = compose_config(FAST + overrides)
    check_config(cfg, world_size)
    ctx = ParallelContext(Layout.from_config(cfg))
    trainer = Trainer(cfg, ctx, run_dir=os.devnull)
    sharded = trainer.grad_sync.engines[0]
    most_gathered, in_flight = [], []   # units whole at once as each module starts; reduce-scatters in flight
    for unit in sharded.scattered.units if sharded.stage.shards_parameters else []:   # as each module's backward starts
        unit.module.register_forward_pre_hook(
            lambda *_: most_gathered.append(sum(u.gathered or u.gather_work is not None
                                                for u in sharded.scattered.units)))
        unit.module.register_full_backward_pre_hook(lambda *_: in_flight.append(len(sharded.scattered.in_flight)))
    trainer.train_step(trainer.batches.next_step(), 1e-3)
    with CommCounter({"dp_cp": ctx.dp_cp_group}) as comm:
        trainer.train_step(trainer.batches.next_step(), 1e-3)
    trainer.batches.close()
    return dict(
        grads_held=sum(p.grad is not None for p in trainer.model.parameters()),
        whole_bytes=sum(p.untyped_storage().nbytes() for u in sharded.scattered.units for p in u.params),
        shard_numel=sum(u.shard_size for u in sharded.scattered.units),
        padded_numel=sum(u.padded for u in sharded.scattered.units),
        most_gathered=max(most_gathered, default=0), num_units=len(sharded.scattered.units),
        most_in_flight=max(in_flight, default=0),
        calls=calls_by_kind(comm.records, "dp_cp"),
        micro_batches=trainer.accumulation)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_rank_holds_its_shard_and_moves_the_analytic_bytes(stage):
    overrides = ["parallelism=dp2tp1pp1", f"optimizer.zero_stage={stage}", "optimizer.zero3_prefetch=1"]
    for r in run_distributed(_one_step, 2, overrides):
        shard_bytes, m = 4 * r["shard_numel"], r["micro_batches"]
        assert r["grads_held"] == 0   # between steps a rank holds only its gradient shard
        assert r["shard_numel"] * 2 == r["padded_numel"]
        # reduce-scatter: every unit once per micro-batch, this rank's output the shard
        assert r["calls"]["reduce_scatter"] == (m * r["num_units"], m * shard_bytes)
        if stage == 2:
            assert r["whole_bytes"] > 0   # whole parameters between steps; their update is all-gathered once
            assert r["calls"]["all_gather"] == (r["num_units"], shard_bytes)
        else:
            assert r["whole_bytes"] == 0   # no parameter held whole between steps
            assert r["most_gathered"] <= 2   # the unit computing and the one prefetched
            # gathered before each forward and again before each backward, every micro-batch
            assert r["calls"]["all_gather"] == (2 * m * r["num_units"], 2 * m * shard_bytes)


@pytest.mark.parametrize("overlap", [True, False])
def test_reduce_scatter_overlap_is_a_stated_choice(overlap):
    """optimizer.zero_overlap_reduce_scatter: a unit's reduce-scatter is still in flight while the next unit's
    backward runs, or was waited for at once (the CPU default, docs/zero.md). Parity of the in-flight path:
    the COMPOSED case dp2-overlap."""
    overrides = ["parallelism=dp2tp1pp1", "optimizer.zero_stage=3", f"optimizer.zero_overlap_reduce_scatter={overlap}"]
    for r in run_distributed(_one_step, 2, overrides):
        assert r["most_in_flight"] == int(overlap)


# -- checkpoints ----------------------------------------------------------------------------------
def test_zero3_resumes_bit_for_bit_on_its_layout(tmp_path):
    run = CONSTANT_LR + ["parallelism=dp2tp1pp2", "optimizer.zero_stage=3", "tokens.train_steps=4",
                         "checkpoint.checkpoint_interval=2"]
    full = train_losses(train(tmp_path / "full", run))
    ckpt = tmp_path / "full" / "checkpoints" / "2"
    resumed = train_losses(train(tmp_path / "resumed", run + [f"checkpoint.resume_checkpoint_path={ckpt}"]))
    assert resumed == full[2:]


@SLOW
def test_checkpoints_move_between_zero_stages_and_layouts(tmp_path, train_once):
    """Saved by ZeRO-3 (dp2 tp2), resumed on one process, saved, resumed by ZeRO-2 (dp2 pp2), saved, resumed
    by ZeRO-3 (dp4): the curve stays the one-process run's. The ZeRO-3 checkpoint holds the same model as a
    ZeRO-1 run of the same steps, and its Hugging Face export gives its logits."""
    tied = CONSTANT_LR + TIED
    reference = train_once(tied + ["tokens.train_steps=8"])[1]
    a = train(tmp_path / "a", tied + ["parallelism=dp2tp2pp1", "optimizer.zero_stage=3",
                                      "parallelism.tp_mode=reduce_scatter", "tokens.train_steps=2"])
    b = train(tmp_path / "b", tied + ["tokens.train_steps=4",
                                      f"checkpoint.resume_checkpoint_path={tmp_path}/a/checkpoints/2"])
    c = train(tmp_path / "c", tied + ["parallelism=dp2tp1pp2", "optimizer.zero_stage=2", "tokens.train_steps=6",
                                      f"checkpoint.resume_checkpoint_path={tmp_path}/b/checkpoints/4"])
    d = train(tmp_path / "d", tied + ["parallelism=dp4tp1pp1", "optimizer.zero_stage=3", "tokens.train_steps=8",
                                      f"checkpoint.resume_checkpoint_path={tmp_path}/c/checkpoints/6"])
    assert_same_steps(a + b + c + d, reference, steps=range(1, 9))   # losses and gradient norms

    zero1 = train(tmp_path / "zero1", tied + ["parallelism=dp2tp2pp1", "optimizer.zero_stage=1",
                                              "parallelism.tp_mode=reduce_scatter", "tokens.train_steps=2"])
    assert train_losses(zero1) == train_losses(a)
    ours, _ = load_single_process(str(tmp_path / "a" / "checkpoints" / "2"))
    theirs, _ = load_single_process(str(tmp_path / "zero1" / "checkpoints" / "2"))
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=name)   # reduction order only
    convert_to_hf(str(tmp_path / "a" / "checkpoints" / "2"), str(tmp_path / "hf"))   # Hugging Face export
    hf = HFLlama.from_pretrained(str(tmp_path / "hf")).eval()
    ids = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(input_ids=ids), atol=LOGITS_ATOL, rtol=0)


# -- a gradient that never comes --------------------------------------------------------------------
class Sometimes(torch.nn.Linear):
    """A linear layer with a parameter it never uses and a scale it uses only when told to."""

    def __init__(self):
        super().__init__(4, 3)
        self.unused, self.scale = torch.nn.Parameter(torch.ones(5)), torch.nn.Parameter(torch.full((3,), 2.0))
        self.use_scale = True

    def forward(self, x):
        return super().forward(x) * (self.scale if self.use_scale else 1.0)


class ThreeLayers(torch.nn.Module):
    """Three units, the last with a parameter it never uses and one a rank's data may leave unused; with
    prefetch 1 stage 3 gathers the earlier units while the later ones are reduced."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.z, self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), Sometimes()

    def forward(self, x, use_b: bool):
        x = self.a(self.z(x))
        return self.b(x) if use_b else x


def _missing_gradients(rank, world_size, stage, skip_b_on_rank1, skip_scale_on_rank1):
    """Each rank's averaged gradient shard, and the average of the ranks' plain autograd gradients."""
    ctx = ParallelContext(Layout(dp=world_size))
    model, reference = ThreeLayers(), ThreeLayers()
    sync = GradientSync([[(module, list(module.parameters())) for module in (model.z, model.a, model.b)]], ctx,
                        stage=stage)
    names = {id(p): n for n, p in model.named_parameters()}
    expected = {}
    for r in range(world_size):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(r))
        use_b = not (skip_b_on_rank1 and r == 1)
        model.b.use_scale = reference.b.use_scale = not (skip_scale_on_rank1 and r == 1)
        if r == rank:
            sync.before_backward(0, last=True)
            model(x, use_b).sum().backward()
            sync.after_backward(0, last=True)
        reference.zero_grad()
        reference(x, use_b).sum().backward()
        for n, p in reference.named_parameters():
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            expected[n] = expected.get(n, 0) + grad.reshape(-1) / world_size
    sync.finish()
    return [(names[id(piece.param)], piece.start, piece.end, piece.grad.clone(), expected[names[id(piece.param)]])
            for piece in sync.shard_pieces()]


@pytest.mark.parametrize("stage, skip_b_on_rank1, skip_scale_on_rank1",
                         [(2, False, False), (2, True, False), (2, False, True), (3, False, False), (3, False, True)])
def test_a_gradient_that_never_comes_counts_as_zeros(stage, skip_b_on_rank1, skip_scale_on_rank1):
    """A parameter its module never uses, one that a rank's data leave unused, and (stage 2) a module one rank
    skips: no rank waits for the missing gradients, every rank issues the same collectives in the same order
    (stage 3: its gathers too), and the average counts them as zeros. (Stage 3 needs every rank to run the same
    modules: a gather is a collective.)"""
    covered = {}
    for pieces in run_distributed(_missing_gradients, 2, stage, skip_b_on_rank1, skip_scale_on_rank1):
        for name, start, end, grad, expected in pieces:
            torch.testing.assert_close(torch.as_tensor(grad), torch.as_tensor(expected)[start:end], atol=1e-6, rtol=0)
            covered[name] = covered.get(name, 0) + end - start
    assert covered == {n: p.numel() for n, p in ThreeLayers().named_parameters()}


def _prefetched(rank, world_size):
    """Stage 3 over three modules, the middle one with no parameter of its own: which units are whole or on
    their way as each module starts."""
    ctx = ParallelContext(Layout(dp=world_size))
    torch.manual_seed(0)
    a, middle, b = torch.nn.Linear(4, 4), torch.nn.Identity(), torch.nn.Linear(4, 4)
    sync = GradientSync([[(a, list(a.parameters())), (middle, []), (b, list(b.parameters()))]], ctx, stage=3)
    units, seen = sync.engines[0].scattered.units, []
    for module in (a, b):   # registered after the sync's own hooks, so they see what it posted
        module.register_forward_pre_hook(
            lambda *_: seen.append([u.gathered or u.gather_work is not None for u in units]))
    with torch.no_grad():   # a forward is all it takes (as in evaluation)
        b(middle(a(torch.randn(2, 4))))
    return [u.index for u in units], seen


def test_zero3_prefetches_the_next_unit_that_has_parameters():
    for indices, seen in run_distributed(_prefetched, 2):
        assert indices == [0, 1]
        assert seen == [[True, True], [False, True]]   # a's forward posts b's gather; a is freed after it
