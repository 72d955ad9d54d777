"""The schedules' communication plans (nanoexp/verify/p2p_plan.py) under NCCL's rules.

Pure-Python checks of the plans and the checker, then the proof that the engines post exactly
their plan: every point-to-point call they make on gloo is recorded and compared op for op.
"""
from __future__ import annotations

import contextlib
import functools
import inspect

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn as nn

from nanoexp.parallel.context import ParallelContext
from nanoexp.parallel.layout import Layout
from nanoexp.parallel.pipeline import PipelineEngine
from nanoexp.parallel.pipeline.schedules import compute_order
from nanoexp.verify.pipeline_bubble import idle_under_nccl
from nanoexp.verify.p2p_plan import PlanError, check, named_plan, plan
from tests.distributed import run_distributed
from tests.test_pipeline import (HIDDEN, MB_SIZE, chunk_layers, make_blocks, make_forward_step, make_micro_batches,
                                 reference, run_engine)


def old_interleaved_plan(pp, v, m):
    """The plan of the interleaved engine before the fix: per compute op of its compute order,
    a receive (blocking) before it and a send (isend) after it, each message on its own. Under
    NCCL each is a batch that must complete before the rank posts the next."""
    out = []
    for r in range(pp):
        batches = []
        for op, chunk, _ in compute_order("interleaved_1f1b", pp, v, m, r):
            stage = chunk * pp + r
            has_prev, has_next = stage > 0, stage < pp * v - 1
            prev, nxt = (r - 1) % pp, (r + 1) % pp
            if op == "F":
                batches += [[("recv", prev, 0)]] * has_prev + [[("send", nxt, 0)]] * has_next
            else:
                batches += [[("recv", nxt, 0)]] * has_next + [[("send", prev, 0)]] * has_prev
        out.append(batches)
    return out


def test_old_interleaved_order_deadlocks_under_nccl_rules():
    # pp=2, v=2, m=2: rank 0 sends micro-batch 1's activation while rank 1 sends micro-batch
    # 0's activation on to rank 0's chunk 1; neither has posted the other's receive.
    with pytest.raises(PlanError, match=r"deadlock: rank 0 is stuck in batch 1 on send to rank 1, .* rank 1 is "
                                        r"stuck in batch 1 \(stuck: rank 0 in batch 1, rank 1 in batch 1\)"):
        check(old_interleaved_plan(2, 2, 2))
    for pp, v, m in [(4, 2, 8), (3, 3, 6), (8, 4, 16)]:
        with pytest.raises(PlanError, match="deadlock"):
            check(old_interleaved_plan(pp, v, m))
        check(plan("interleaved_1f1b", pp, v, m))   # the engine's plan for the same shape runs


def test_every_engine_plan_passes_nccl_rules():
    """Every engine, pp 2..8, m 1..16 (interleaved: v 1..4, m a multiple of pp when training),
    training and evaluation. named_plan carries each message's name, so check() also proves
    that on every channel the receiver asks for the messages in the order they are sent."""
    plans = batches = 0
    for pp in range(2, 9):
        for m in range(1, 17):
            shapes = [("afab", 1), ("1f1b", 1)] + [("interleaved_1f1b", v) for v in range(1, 5)]
            for engine, v in shapes:
                for forward_only in (False, True):
                    if engine == "interleaved_1f1b" and not forward_only and m % pp:
                        continue
                    batches += check(named_plan(engine, pp, v, m, forward_only))
                    plans += 1
    assert plans == 1000 and batches > 100_000


def test_plan_format_and_a_1f1b_example():
    assert list(inspect.signature(plan).parameters) == ["engine", "pp", "v", "m", "forward_only"]
    # 1F1B, pp=2, m=2. Rank 0: F0, send; F1, send + receive B0's gradient; B0; receive; B1.
    # Rank 1: receive; F0 B0; send B0's gradient + receive F1's input; F1 B1; send.
    assert plan("1f1b", 2, 1, 2) == [
        [[("send", 1, 0)], [("send", 1, 0), ("recv", 1, 0)], [("recv", 1, 0)]],
        [[("recv", 0, 0)], [("send", 0, 0), ("recv", 0, 0)], [("send", 0, 0)]]]
    assert plan("afab", 2, 1, 1, forward_only=True) == [[[("send", 1, 0)]], [[("recv", 0, 0)]]]
    with pytest.raises(ValueError, match="multiple"):
        plan("interleaved_1f1b", 4, 2, 6)
    with pytest.raises(ValueError, match="unknown"):
        plan("gpipe", 2, 1, 2)


def test_checker_follows_nccl_rules():
    send, recv = ("send", 1, 0), ("recv", 1, 0)
    to0, from0 = ("send", 0, 0), ("recv", 0, 0)
    # Both send first, each in its own batch: a send waits for its receive -> deadlock.
    with pytest.raises(PlanError, match="rank 0 is stuck in batch 0 on send to rank 1"):
        check([[[send], [recv]], [[to0], [from0]]])
    # The same ops in one batch per rank, or one side receiving first, run.
    assert check([[[send, recv]], [[to0, from0]]]) == 2
    assert check([[[send], [recv]], [[from0], [to0]]]) == 4
    # Two sends in separate batches meet two receives in one: each send only needs its receive posted.
    assert check([[[send], [send]], [[from0, from0]]]) == 3
    # A ring of ranks that all send before receiving deadlocks; naming every stuck rank.
    ring = [[[("send", (r + 1) % 3, 0)], [("recv", (r - 1) % 3, 0)]] for r in range(3)]
    with pytest.raises(PlanError, match="stuck: rank 0 in batch 0, rank 1 in batch 0, rank 2 in batch 0"):
        check(ring)
    with pytest.raises(PlanError, match="no matching recv"):
        check([[[send]], []])
    with pytest.raises(PlanError, match="no valid peer"):
        check([[[("send", 0, 0)]], []])
    # Tags do not exist: the first send meets the first receive, so swapped names are an error.
    with pytest.raises(PlanError, match="partner is"):
        check([[[("send", 1, 0, "a"), ("send", 1, 0, "b")]], [[("recv", 0, 0, "b"), ("recv", 0, 0, "a")]]])


@pytest.mark.parametrize("engine,v", [("afab", 1), ("1f1b", 1)] + [("interleaved_1f1b", v) for v in (1, 2, 3, 4)])
def test_blocking_sends_keep_the_ideal_bubble(engine, v):
    """The batching costs no bubble: as the engine posts and waits under NCCL's rules (sends wait for their
    receive, batches run in order on one stream: nanoexp.verify.pipeline_bubble) with free communication, the idle fraction is still exactly (p-1)/(v*m+p-1), the
    figure of the compute order alone (tests/test_pipeline.py). Exact up to float rounding of
    sums of a few hundred terms, hence 1e-12."""
    for pp in range(2, 9):
        step = pp if engine == "interleaved_1f1b" else 1   # interleaved: m a multiple of pp
        for m in range(step, 17, step):
            for t_forward, t_backward in [(1.0, 2.0), (1.0, 1.0)]:
                span = idle_under_nccl(engine, pp, v, m, t_forward, t_backward) + m * (t_forward + t_backward)
                assert 1 - m * (t_forward + t_backward) / span == pytest.approx((pp - 1) / (v * m + pp - 1), abs=1e-12)


# -- what the engines really post ------------------------------------------------------------

@contextlib.contextmanager
def recorded_p2p(ctx):
    """While active, every point-to-point call of this process is appended to the yielded list
    as one batch [(verb, peer pp rank, nbytes)]: a batch_isend_irecv as its ops, a lone
    send/recv/isend/irecv as a batch of one. Both namespaces are wrapped, because P2POp checks
    its op against c10d's own isend/irecv."""
    posted, originals, depth = [], {}, [0]

    def describe(verb, peer, tensor):
        return verb, peer // (ctx.dp * ctx.tp), tensor.numel() * tensor.element_size()

    def wrap(name, original):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            if depth[0] == 0:   # the calls batch_isend_irecv makes itself are part of its batch
                if name == "batch_isend_irecv":
                    posted.append([describe(op.op.__name__[1:], op.peer, op.tensor) for op in args[0]])
                else:
                    posted.append([(name, args[1] if len(args) > 1 else None, 0)])
            depth[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1
        return wrapper

    for name in ("send", "recv", "isend", "irecv", "batch_isend_irecv"):
        originals[name] = getattr(c10d, name)
        wrapper = wrap(name, originals[name])
        setattr(c10d, name, wrapper)
        setattr(dist, name, wrapper)
    try:
        yield posted
    finally:
        for name, original in originals.items():
            setattr(c10d, name, original)
            setattr(dist, name, original)


def run_forward_only(ctx, engine_name, num_micro, num_chunks):
    blocks = make_blocks()
    chunks = [nn.Sequential(*[blocks[i] for i in ids]) for ids in chunk_layers(ctx, num_chunks)]
    engine = PipelineEngine(ctx, engine_name, num_chunks)
    return engine.forward_only(make_forward_step(ctx, chunks, num_micro), make_micro_batches(num_micro),
                               (MB_SIZE, HIDDEN), torch.float32)


def _recording_worker(rank, world_size, pp, dp, cases):
    ctx = ParallelContext(Layout(dp=dp, pp=pp))
    out = []
    for engine, v, m, forward_only in cases:
        with recorded_p2p(ctx) as posted:
            if forward_only:
                losses = run_forward_only(ctx, engine, m, v)
            else:
                losses = run_engine(ctx, engine, m, v)["losses"]
        out.append((posted, [loss.item() for loss in losses]))
    return ctx.pp_rank, out


CASES = {   # (pp, dp): [(engine, v, m, forward_only)]; dp=2 makes peers' global ranks differ from pp ranks
    (2, 2): [("afab", 1, 3, False), ("1f1b", 1, 3, False), ("interleaved_1f1b", 2, 4, False),
             ("interleaved_1f1b", 4, 2, False), ("1f1b", 1, 2, True), ("interleaved_1f1b", 3, 3, True)],
    (3, 1): [("1f1b", 1, 2, False), ("interleaved_1f1b", 2, 6, False), ("interleaved_1f1b", 2, 2, True)],
    (4, 1): [("afab", 1, 2, False), ("1f1b", 1, 6, False), ("interleaved_1f1b", 2, 8, False),
             ("afab", 1, 3, True), ("interleaved_1f1b", 2, 5, True)],
}


@pytest.mark.parametrize("pp,dp", list(CASES))
def test_engines_post_exactly_their_plan(pp, dp):
    """Each engine's recorded point-to-point calls on gloo equal p2p_plan.plan for its pp rank:
    the same batches, and in each the same ops (direction, peer) in the same order."""
    results = run_distributed(_recording_worker, pp * dp, pp, dp, CASES[pp, dp])
    for pp_rank, runs in results:
        for (engine, v, m, forward_only), (posted, losses) in zip(CASES[pp, dp], runs):
            expected = plan(engine, pp, v, m, forward_only)[pp_rank]
            assert [[op[:2] for op in batch] for batch in posted] == [[op[:2] for op in batch] for batch in expected]
            assert {op[2] for batch in posted for op in batch} <= {MB_SIZE * HIDDEN * 4}   # float32 activations
            if pp_rank == pp - 1:   # the schedule also computes the right thing (float32: 1e-6, only sum order)
                assert losses == pytest.approx([loss.item() for loss in reference(m)[1]], abs=1e-6, rel=1e-6)
