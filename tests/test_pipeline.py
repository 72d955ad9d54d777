"""The pipeline engine running each schedule (nanoexp/parallel/pipeline/) on a toy model over forked gloo ranks.

The toy model is NUM_LAYERS blocks of Linear + tanh; the last stage's loss is the MSE of a
micro-batch scaled by 1/num_micro_batches, so summing over micro-batches gives the step loss.
Gradients are compared with a single-process run of the whole model over the same
micro-batches. In float32 only the summation order can differ, hence atol/rtol 1e-6.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
# Imported here, not in the workers: forked ranks inherit it instead of each paying the import.
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

from nanoexp.parallel.context import ParallelContext
from nanoexp.parallel.layout import Layout
from nanoexp.parallel.pipeline import PipelineEngine
from nanoexp.parallel.pipeline.schedules import compute_order
from tests.distributed import run_distributed

HIDDEN, MB_SIZE, NUM_LAYERS = 8, 4, 8
TOL = dict(atol=1e-6, rtol=1e-6)  # float32, only the summation order differs


def make_blocks() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(NUM_LAYERS)]


def make_micro_batches(num: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(MB_SIZE, HIDDEN, generator=g), torch.randn(MB_SIZE, HIDDEN, generator=g))
            for _ in range(num)]


def grads_by_layer(blocks, layers) -> dict[int, list[torch.Tensor]]:
    return {i: [p.grad.clone() for p in block.parameters()] for i, block in zip(layers, blocks)}


def reference(num_micro: int):
    """One process, whole model, plain gradient accumulation: (grads by layer, losses)."""
    blocks = make_blocks()
    model = nn.Sequential(*blocks)
    losses = []
    for x, target in make_micro_batches(num_micro):
        loss = F.mse_loss(model(x), target) / num_micro
        loss.backward()
        losses.append(loss.detach())
    return grads_by_layer(blocks, range(NUM_LAYERS)), losses


def chunk_layers(ctx, num_chunks: int) -> list[range]:
    """This rank's layers per chunk: chunk c is virtual stage c*pp + pp_rank of pp*num_chunks."""
    return Layout(pp=ctx.pp, virtual_stages=num_chunks).stage_layers(NUM_LAYERS, ctx.pp_rank)


def make_forward_step(ctx, chunks, num_micro):
    def forward_step(micro_batch, input_tensor, chunk):
        x, target = micro_batch
        out = chunks[chunk](x if input_tensor is None else input_tensor)
        is_loss = ctx.is_last_stage and chunk == len(chunks) - 1
        return F.mse_loss(out, target) / num_micro if is_loss else out
    return forward_step


def run_engine(ctx, name, num_micro, num_chunks=1):
    """Run one engine on this rank's chunks; returns grads, losses, max_in_flight and the
    order of events: ("grad", c) per backward through chunk c, ("before", c) / ("last", c) / ("after", c)
    for the gradient sync's calls before a backward through chunk c (its last) and after it."""
    layers = chunk_layers(ctx, num_chunks)
    blocks = make_blocks()
    chunks = [nn.Sequential(*[blocks[i] for i in ids]) for ids in layers]
    events = []
    for c, chunk in enumerate(chunks):
        chunk[0][0].weight.register_hook(lambda g, c=c: events.append(("grad", c)))
    engine = PipelineEngine(ctx, name, num_chunks)
    losses = engine.run(make_forward_step(ctx, chunks, num_micro), make_micro_batches(num_micro),
                        (MB_SIZE, HIDDEN), torch.float32, grad_sync=SyncRecorder(events))
    mine = [i for ids in layers for i in ids]
    return dict(grads=grads_by_layer([blocks[i] for i in mine], mine), losses=losses,
                max_in_flight=engine.max_in_flight, events=events)


class SyncRecorder:
    """Stands in for GradientSync: records the engine's calls around each backward."""

    def __init__(self, events: list):
        self.events = events

    def before_backward(self, chunk, last):
        self.events.append(("last" if last else "before", chunk))

    def after_backward(self, chunk, last):
        self.events.append(("after", chunk))


def assert_hook_before_last_backward(events, num_chunks, num_micro):
    """Every backward through chunk c sits between before_backward(c) and after_backward(c); the last of
    the step is flagged."""
    for c in range(num_chunks):
        mine = [e for e in events if e[1] == c]
        each = [("before", c), ("grad", c), ("after", c)]
        assert mine == each * (num_micro - 1) + [("last", c), ("grad", c), ("after", c)], (c, events)


def run_torch_reference(ctx, num_micro, num_chunks=1):
    """The same chunks and micro-batches under torch.distributed.pipelining's Schedule1F1B
    (one chunk per rank) or ScheduleInterleaved1F1B (stage c*pp + r on rank r, as ours)."""
    layers = chunk_layers(ctx, num_chunks)
    blocks = make_blocks()
    stages = [PipelineStage(nn.Sequential(*[blocks[i] for i in ids]), c * ctx.pp + ctx.pp_rank,
                            ctx.pp * num_chunks, torch.device("cpu"), group=ctx.pp_group)
              for c, ids in enumerate(layers)]
    # Its loss_fn gets one micro-batch and is NOT scaled by the caller; with scale_grads=True
    # (the default) it divides the gradients by n_microbatches after the step instead. So an
    # unscaled MSE here equals our MSE / num_micro, and its losses are ours * num_micro.
    if num_chunks == 1:
        schedule = Schedule1F1B(stages[0], num_micro, loss_fn=F.mse_loss, scale_grads=True)
    else:
        schedule = ScheduleInterleaved1F1B(stages, num_micro, loss_fn=F.mse_loss, scale_grads=True)
    mbs = make_micro_batches(num_micro)
    # It splits the full batch along dim 0 into equal chunks: exactly our micro-batches.
    inputs = torch.cat([x for x, _ in mbs])
    targets = torch.cat([t for _, t in mbs])
    losses = []
    if ctx.is_first_stage:
        schedule.step(inputs)
    elif ctx.is_last_stage:
        schedule.step(target=targets, losses=losses)
    else:
        schedule.step()
    mine = [i for ids in layers for i in ids]
    return dict(grads=grads_by_layer([blocks[i] for i in mine], mine),
                losses=[l.detach() / num_micro for l in losses])


def portable(obj):
    """Tensors -> numpy arrays and back, recursively. Tensors put on the result queue as-is
    travel through shared memory that dies with the worker, so ship plain copies."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().numpy().copy()
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: portable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(portable(v) for v in obj)
    return obj


def _pipeline_worker(rank, world_size, pp, dp, num_micro, with_torch):
    ctx = ParallelContext(Layout(dp=dp, pp=pp))
    out = {name: run_engine(ctx, name, num_micro) for name in ("afab", "1f1b")}
    if with_torch:
        out["torch"] = run_torch_reference(ctx, num_micro)
    out["pp_rank"] = ctx.pp_rank
    return portable(out)


def assert_grads_close(got, expected, **tol):
    for layer, grads in got.items():
        for g, ref in zip(grads, expected[layer]):
            torch.testing.assert_close(g, ref, **tol)


# (2, 2, 3): two data-parallel replicas, so stage neighbours are not rank +- 1.
@pytest.mark.parametrize("pp,dp,num_micro", [(2, 1, 4), (4, 1, 6), (2, 2, 3)])
def test_engines_match_single_process_and_torch(pp, dp, num_micro):
    ref_grads, ref_losses = reference(num_micro)
    results = portable(run_distributed(_pipeline_worker, pp * dp, pp, dp, num_micro, True))
    covered = set()
    for res in results:
        r, afab, ofob, torch_ref = res["pp_rank"], res["afab"], res["1f1b"], res["torch"]
        covered |= set(afab["grads"])
        # 1. both engines reproduce single-process gradient accumulation
        assert_grads_close(afab["grads"], ref_grads, **TOL)
        assert_grads_close(ofob["grads"], ref_grads, **TOL)
        # 2. AFAB and 1F1B run the same per-micro-batch ops in the same backward order
        assert_grads_close(ofob["grads"], afab["grads"], atol=0, rtol=0)
        assert afab["max_in_flight"] == num_micro
        assert 1 <= ofob["max_in_flight"] <= pp - r
        # 3. torch.distributed.pipelining's Schedule1F1B agrees
        assert_grads_close(torch_ref["grads"], ofob["grads"], **TOL)
        # 4. the gradient sync hears of every backward through the stage, the last one flagged
        for engine in (afab, ofob):
            assert_hook_before_last_backward(engine["events"], 1, num_micro)
        # losses: per micro-batch, only on the last stage
        if r == pp - 1:
            for losses in (afab["losses"], ofob["losses"], torch_ref["losses"]):
                torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), **TOL)
                assert not losses[0].requires_grad
        else:
            assert afab["losses"] == [] and ofob["losses"] == []
    assert covered == set(range(NUM_LAYERS))


def _few_micro_batches_worker(rank, world_size, counts):
    ctx = ParallelContext(Layout(pp=world_size))
    return portable((ctx.pp_rank, [run_engine(ctx, "1f1b", m) for m in counts]))


def test_1f1b_with_fewer_micro_batches_than_stages():
    # pp=4 with 1 and 3 micro-batches: the warm-up is capped, the schedule only has more bubble.
    counts = [1, 3]
    results = portable(run_distributed(_few_micro_batches_worker, 4, counts))
    for m, i in zip(counts, range(len(counts))):
        ref_grads, ref_losses = reference(m)
        for r, runs in results:
            res = runs[i]
            assert_grads_close(res["grads"], ref_grads, **TOL)
            assert res["max_in_flight"] <= min(m, 4 - r)
            assert_hook_before_last_backward(res["events"], 1, m)
            if r == 3:
                torch.testing.assert_close(torch.stack(res["losses"]), torch.stack(ref_losses), **TOL)


@pytest.mark.parametrize("name", ["afab", "1f1b"])
def test_pp1_is_plain_gradient_accumulation(name):
    ctx = ParallelContext()  # one process, no process group
    res = run_engine(ctx, name, 3)
    ref_grads, ref_losses = reference(3)
    assert_grads_close(res["grads"], ref_grads, atol=0, rtol=0)  # identical ops and order
    torch.testing.assert_close(torch.stack(res["losses"]), torch.stack(ref_losses), atol=0, rtol=0)
    assert res["max_in_flight"] == 1
    assert_hook_before_last_backward(res["events"], 1, 3)


def test_engine_refuses_a_schedule_it_cannot_run():
    ctx = ParallelContext()
    with pytest.raises(ValueError, match="unknown pipeline engine"):
        PipelineEngine(ctx, "gpipe")
    with pytest.raises(ValueError, match="needs parallelism.pp_engine=interleaved_1f1b"):   # chunks: interleaved
        PipelineEngine(ctx, "1f1b", num_chunks=2)
    with pytest.raises(ValueError, match="at least 2 pipeline ranks"):   # one rank has no ring to interleave
        PipelineEngine(ctx, "interleaved_1f1b", num_chunks=2)
    ctx.pp = 2
    assert PipelineEngine(ctx, "interleaved_1f1b", num_chunks=3).num_chunks == 3


def test_wrong_activation_shape_is_reported():
    ctx = ParallelContext()
    engine = PipelineEngine(ctx, "1f1b")
    # With pp == 1 the stage is also the last stage, so use a fake 2-stage view of it.
    ctx.layout, ctx.pp, ctx.pp_rank = Layout(pp=2), 2, 0
    with pytest.raises(ValueError, match="tensor_shape"):
        engine.run(lambda mb, x, chunk: torch.zeros(3, requires_grad=True), [None], (2,), torch.float32)


# -- interleaved 1F1B ------------------------------------------------------------------------

def simulate_interleaved(pp, v, m, t_forward=1.0, t_backward=2.0) -> list[dict]:
    """Execute every rank's interleaved compute order with fixed chunk times (t/v per chunk) and free
    communication, each op as soon as its input is ready; returns trace-like events.
    Raises AssertionError if the ranks' orders deadlock (no rank can make progress)."""
    orders = [compute_order("interleaved_1f1b", pp, v, m, r) for r in range(pp)]
    position, clock, finished, events = [0] * pp, [0.0] * pp, {}, []
    progress = True
    while progress:
        progress = False
        for r in range(pp):
            if position[r] == len(orders[r]):
                continue
            op, chunk, mb = orders[r][position[r]]
            stage = chunk * pp + r
            if op == "F":
                needs = ("F", stage - 1, mb) if stage > 0 else None
            else:
                needs = ("B", stage + 1, mb) if stage < pp * v - 1 else ("F", stage, mb)
            if needs is not None and needs not in finished:
                continue
            start = max(clock[r], finished.get(needs, 0.0))
            clock[r] = start + (t_forward if op == "F" else t_backward) / v
            finished[op, stage, mb] = clock[r]
            events.append({"rank": r, "pp_rank": r, "dp_rank": 0, "tp_rank": 0, "step": 1, "mb": mb,
                           "chunk": chunk, "kind": "forward" if op == "F" else "backward",
                           "start": start, "end": clock[r]})
            position[r] += 1
            progress = True
    assert all(position[r] == len(orders[r]) for r in range(pp)), f"deadlock at pp={pp} v={v} m={m}"
    return events


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("v", [1, 2, 3, 4])
@pytest.mark.parametrize("rounds", [1, 2, 4])
def test_interleaved_order_runs_and_meets_the_theoretical_bubble(pp, v, rounds):
    """Pure schedule check (no processes): every (chunk, micro-batch) is run forward then
    backward once, each chunk's backwards in micro-batch order; the ranks' orders cannot
    deadlock; and with equal stages and free communication the idle fraction is exactly
    (p-1)/(v*m+p-1) (Narayanan et al. 2021, section 2.2.2)."""
    m = rounds * pp
    for r in range(pp):
        order = compute_order("interleaved_1f1b", pp, v, m, r)
        assert sorted(order) == sorted((op, c, i) for op in "FB" for c in range(v) for i in range(m))
        for c in range(v):
            assert [i for op, cc, i in order if op == "B" and cc == c] == list(range(m))
            for i in range(m):
                assert order.index(("F", c, i)) < order.index(("B", c, i))
    events = simulate_interleaved(pp, v, m)
    makespan = max(e["end"] for e in events)
    busy = m * (1.0 + 2.0)   # per rank: m micro-batches x (forward + backward), over all chunks
    assert abs((1 - busy / makespan) - (pp - 1) / (v * m + pp - 1)) < 1e-12


def test_interleaved_order_needs_a_multiple_of_pp_micro_batches():
    with pytest.raises(ValueError, match="multiple"):
        compute_order("interleaved_1f1b", 4, 2, 6, 0)


def _interleaved_worker(rank, world_size, pp, dp, num_chunks, num_micro):
    ctx = ParallelContext(Layout(dp=dp, pp=pp))
    return portable({"pp_rank": ctx.pp_rank,
                     "ours": run_engine(ctx, "interleaved_1f1b", num_micro, num_chunks),
                     "afab": run_engine(ctx, "afab", num_micro),
                     "torch": run_torch_reference(ctx, num_micro, num_chunks)})


# (4, 1, 2, 8): 8 virtual stages of one layer; (2, 2, 3, 2): uneven chunks (2,2,1,1,1,1 layers),
# two replicas (neighbours are not rank +- 1) and a single round of micro-batches.
@pytest.mark.parametrize("pp,dp,num_chunks,num_micro", [(2, 1, 2, 4), (4, 1, 2, 8), (2, 2, 3, 2)])
def test_interleaved_matches_single_process_and_torch(pp, dp, num_chunks, num_micro):
    ref_grads, ref_losses = reference(num_micro)
    results = portable(run_distributed(_interleaved_worker, pp * dp, pp, dp, num_chunks, num_micro))
    covered = set()
    for res in results:
        ours, torch_ref = res["ours"], res["torch"]
        covered |= set(ours["grads"])
        assert_grads_close(ours["grads"], ref_grads, **TOL)
        assert_grads_close(torch_ref["grads"], ours["grads"], **TOL)
        # Each layer sees the same ops in the same micro-batch order as in AFAB: bit for bit.
        afab_grads = res["afab"]["grads"]
        assert_grads_close({i: g for i, g in ours["grads"].items() if i in afab_grads}, afab_grads, atol=0, rtol=0)
        assert_hook_before_last_backward(ours["events"], num_chunks, num_micro)
        assert 1 <= ours["max_in_flight"] <= num_chunks * num_micro
        if res["pp_rank"] == pp - 1:
            for losses in (ours["losses"], torch_ref["losses"]):
                torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), **TOL)
        else:
            assert ours["losses"] == []
    assert covered == set(range(NUM_LAYERS))


@pytest.mark.parametrize("overrides,message", [
    (["parallelism.pp_virtual_stages=2"], "parallelism.pp_virtual_stages=2 needs parallelism.pp_engine=interleaved_1f1b"),
    (["parallelism.pp_engine=interleaved_1f1b", "parallelism.pp_virtual_stages=1"], "at least 2 chunks"),
    (["parallelism.pp_engine=interleaved_1f1b", "parallelism.pp_virtual_stages=4"], "num_hidden_layers=4"),
    (["parallelism.pp_engine=interleaved_1f1b", "parallelism.pp_virtual_stages=2", "tokens.global_batch_size=6"],
     "not a multiple of parallelism.pp=2"),
])
def test_interleaved_config_errors_name_the_key(overrides, message):
    from nanoexp.config import ConfigError
    from nanoexp.validation import validate
    from tests.helpers import FAST, compose_config
    with pytest.raises(ConfigError, match=message):
        validate(compose_config(FAST + ["parallelism=dp1tp1pp2"] + overrides))
