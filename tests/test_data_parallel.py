"""Gradient synchronisation (GradientSync over flat buffers, all_reduce_grads) and ZeRO-1 AdamW on gloo ranks.

Tolerances: dp results differ from the single-process reference only in floating-point
summation order (per-rank partial sums, then an all-reduce), so float32 values agree to
~1e-7 relative; we assert max abs error < 1e-6 on O(0.1-1) values.
"""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from nanoexp.parallel.context import ParallelContext
from nanoexp.parallel.layout import Layout
from nanoexp.parallel.gradient_sync import GradientSync, all_reduce_grads
from nanoexp.parallel.zero.engine import ZeroOptions
from nanoexp.parallel.zero.sharded_optimizer import ShardedOptimizer
from tests.distributed import run_distributed

TOL = 1e-6
BATCH, MICRO = 16, 2  # global batch; micro-batches of gradient accumulation


# Tensors returned from a rank travel through shared-memory file descriptors that vanish
# when the rank exits, so ranks return plain lists and the parent rebuilds tensors.
def plain(t):
    return None if t is None else (t.tolist(), str(t.dtype).split(".")[-1])


def tensor(x):
    return None if x is None else torch.tensor(x[0], dtype=getattr(torch, x[1]))


def make_mlp(unused: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
              nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)]
    model = nn.Sequential(*layers)
    if unused:
        model.add_module("unused", nn.Linear(4, 4))   # never in forward on any rank
        model.add_module("rank0_only", nn.Linear(4, 4))  # in forward on rank 0 only
    return model


def make_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)


def forward_loss(model, x, y):
    return nn.functional.mse_loss(model[:7](x), y)


class LaunchRecorder:
    """A pipeline trace (nanoexp.instruments.trace's interface) that keeps the bucket launches in memory."""

    def __init__(self):
        self.launches = []   # (bucket, in_backward) in launch order

    def bind(self, **fields):
        return self

    def span(self, kind, **fields):
        return contextlib.nullcontext()

    def mark(self, kind, **fields):
        if kind == "allreduce_launch":
            self.launches.append((fields["bucket"], fields["in_backward"]))


def _count_reductions(counter: list) -> dict:
    """Wrap dist.all_reduce and dist.reduce_scatter_tensor (process-local: each rank is a forked
    process); returns the originals to restore."""
    names = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single")
    originals = {name: getattr(dist, name) for name in names if hasattr(dist, name)}

    def counting(original):
        def call(*args, **kwargs):
            counter.append(1)
            return original(*args, **kwargs)
        return call
    for name, original in originals.items():
        setattr(dist, name, counting(original))
    return originals


def _buckets_worker(rank, world, shard=False):
    ctx = ParallelContext(Layout(dp=world))
    model = make_mlp()
    reference = copy.deepcopy(model)
    # ~0.004 MB: about one 32x32 weight per bucket, so several buckets.
    recorder = LaunchRecorder()
    sync = GradientSync([list(model.parameters())], ctx, stage=int(shard), options=ZeroOptions(bucket_cap_mb=0.0042),
                        trace=recorder)
    x, y = make_batch()
    per_rank = BATCH // world
    xs, ys = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
    calls: list = []
    originals = _count_reductions(calls)
    try:
        for mb, (xm, ym) in enumerate(zip(xs.chunk(MICRO), ys.chunk(MICRO))):
            if mb == MICRO - 1:
                calls_before_last = len(calls)
                sync.before_backward(0, last=True)
            (forward_loss(model, xm, ym) / MICRO).backward()
        calls_after_backward = len(calls)
        sync.finish()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)

    forward_loss(reference, x, y).backward()  # full batch, one process
    if shard:   # only this rank's shard of each bucket holds the average (reduce-scatter)
        ref = {id(p): r for p, r in zip(model.parameters(), reference.parameters())}
        err = max((piece.grad - ref[id(piece.param)].grad.reshape(-1)[piece.start:piece.end]).abs().max().item()
                  for piece in sync.shard_pieces())
    else:
        err = max((p.grad - r.grad).abs().max().item() for p, r in zip(model.parameters(), reference.parameters()))
    return dict(err=err, num_buckets=len(sync.engines[0].accumulated.units), calls_before_last=calls_before_last,
                in_backward=sum(in_backward for _, in_backward in recorder.launches),
                calls_in_backward=calls_after_backward, launch_order=[bucket for bucket, _ in recorder.launches])


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("shard", [False, True], ids=["all_reduce", "reduce_scatter"])
def test_gradient_buckets_match_full_batch(world, shard):
    for r in run_distributed(_buckets_worker, world, shard):
        assert r["err"] < TOL
        assert r["num_buckets"] >= 3
        assert r["calls_before_last"] == 0  # no traffic on non-final micro-batches
        assert r["in_backward"] >= 1 and r["calls_in_backward"] >= 1  # overlap with backward
        assert r["launch_order"] == list(range(r["num_buckets"]))


def _unused_worker(rank, world):
    ctx = ParallelContext(Layout(dp=world))
    model = make_mlp(unused=True)
    sync = GradientSync([list(model.parameters())], ctx, options=ZeroOptions(bucket_cap_mb=0.001))
    x, y = make_batch()
    sync.before_backward(0, last=True)
    out = model[:7](x[rank::world])
    if rank == 0:  # data-dependent use: only rank 0's backward fires these hooks
        out = model.rank0_only(out)
    loss = nn.functional.mse_loss(out, y[rank::world])
    loss.backward()
    local_rank0_only = [p.grad.clone() for p in model.rank0_only.parameters()]
    sync.finish()
    return dict(unused=[plain(p.grad) for p in model.unused.parameters()],
                rank0_only=[plain(p.grad) for p in model.rank0_only.parameters()],
                local=[plain(g) for g in local_rank0_only])


def test_unused_and_rank_dependent_params_do_not_hang():
    world = 2
    results = run_distributed(_unused_worker, world)
    for r in results:
        assert all(torch.equal(tensor(g), torch.zeros_like(tensor(g))) for g in r["unused"])
        for g, g_local0 in zip(r["rank0_only"], results[0]["local"]):
            torch.testing.assert_close(tensor(g), tensor(g_local0) / world, atol=TOL, rtol=0)
    assert all(torch.equal(tensor(g), torch.zeros_like(tensor(g))) for g in results[1]["local"])   # unused there


def test_single_process_is_free_and_grads_are_buffer_views():
    model = make_mlp()
    reference = copy.deepcopy(model)
    sync = GradientSync([list(model.parameters())], ParallelContext())
    engine = sync.engines[0]
    assert not engine.enabled and len(engine.accumulated.units) == 1
    buckets = engine.accumulated.units[0]
    sync.before_backward(0, last=True)
    forward_loss(model, *make_batch()).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    sync.finish()
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters()))
    # Parameters and gradients are views of the two flat buffers, with the same values as before.
    assert all(p.untyped_storage().data_ptr() == buckets.values.untyped_storage().data_ptr() for p in model.parameters())
    assert all(p.grad.untyped_storage().data_ptr() == buckets.grads.untyped_storage().data_ptr()
               for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    forward_loss(reference, *make_batch()).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
    sync.zero_grad()
    assert all(not p.grad.any() for p in model.parameters()) and not buckets.grads.any()


def _all_reduce_grads_worker(rank, world):
    ctx = ParallelContext(Layout(dp=world))
    a = nn.Parameter(torch.zeros(3, 4))
    b = nn.Parameter(torch.zeros(5, dtype=torch.bfloat16))
    c = nn.Parameter(torch.zeros(2))  # no grad on any rank
    a.grad = torch.full((4, 3), float(rank + 1)).t()  # non-contiguous grad
    b.grad = torch.full((5,), float(rank + 1), dtype=torch.bfloat16)
    all_reduce_grads([a, b, c], ctx.dp_group)
    return plain(a.grad), plain(b.grad), plain(c.grad)


def test_all_reduce_grads_sums_flat_per_dtype():
    world = 4
    total = sum(range(1, world + 1))
    for result in run_distributed(_all_reduce_grads_worker, world):
        a, b, c = map(tensor, result)
        assert torch.equal(a, torch.full((3, 4), float(total)))
        assert b.dtype == torch.bfloat16 and torch.equal(b, torch.full((5,), float(total), dtype=b.dtype))
        assert torch.equal(c, torch.zeros(2))


# -- ZeRO-1 AdamW ----------------------------------------------------------------------------
SHAPES = [(7, 5), (5,), (3, 3), (13,)]  # 62 elements: padding needed for dp=4
# A large eps so that where eps enters the formula changes the result beyond TOL.
ADAM = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-3)


def make_params():
    torch.manual_seed(3)
    return [nn.Parameter(torch.randn(*s)) for s in SHAPES]


def groups_of(params):
    decay = [p for p in params if p.dim() == 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def set_grads(params, step):
    g = torch.Generator().manual_seed(100 + step)  # same on every rank
    for p in params:
        if p.grad is None:
            p.grad = torch.randn(p.shape, generator=g)
        else:
            p.grad.copy_(torch.randn(p.shape, generator=g))   # keep the flat buffer's views


def run_zero_vs_torch(ctx, steps=5):
    """Every rank sets the same gradients, so the shard's 'average' is that gradient; the update of
    the shard pieces followed by the all-gather must equal torch's AdamW on the whole parameters."""
    ours, ref = make_params(), make_params()
    sync = GradientSync([ours], ctx, stage=1, options=ZeroOptions(bucket_cap_mb=0.0001))   # several buckets
    opt = ShardedOptimizer(sync, groups_of(ours), torch.optim.AdamW, **ADAM)
    torch_opt = torch.optim.AdamW(groups_of(ref), foreach=False, **ADAM)
    for step in range(steps):
        lr = ADAM["lr"] * (1 - step / 10)  # what a scheduler would do
        for o in (opt, torch_opt):
            for g in o.param_groups:
                g["lr"] = lr
        set_grads(ours, step)
        set_grads(ref, step)
        opt.step()
        torch_opt.step()
        opt.zero_grad()
        torch_opt.zero_grad()
    err = max((a - b).abs().max().item() for a, b in zip(ours, ref))
    state = sum(s["exp_avg"].numel() + s["exp_avg_sq"].numel() for s in opt.state.values())
    return dict(err=err, state=state, total=sum(p.numel() for p in ours),
                buckets=len(sync.engines[0].accumulated.units),
                params=[plain(p.detach()) for p in ours], steps=opt.num_steps)


def _zero_worker(rank, world):
    return run_zero_vs_torch(ParallelContext(Layout(dp=world)))


@pytest.mark.parametrize("world", [2, 4])
def test_zero_adamw_matches_torch(world):
    results = run_distributed(_zero_worker, world)
    for r in results:
        assert r["err"] < TOL and r["steps"] == 5 and r["buckets"] >= 2
        assert r["state"] <= 2 * (r["total"] // world + r["buckets"])  # 1/dp of 2 x total, plus padding
        for a, b in zip(r["params"], results[0]["params"]):
            assert a == b  # identical on every rank
    assert sum(r["state"] for r in results) == 2 * results[0]["total"]   # the shards cover every element once


def test_zero_adamw_single_process():
    assert run_zero_vs_torch(ParallelContext())["err"] < TOL
