"""Tensor-parallel layers against their unsharded PyTorch references, on 2 and 4 gloo ranks.

Every rank builds the same full reference module and inputs from one seed, copies its shard of
the reference weights into the tp layer (``local_slice``), feeds it its share of the input and
checks its share of the outputs, input gradients and weight gradients.

Tolerance: float32 on both sides and only the summation order differs (partial sums reduced
across ranks), so errors are a few float32 ulps of the largest value: we allow
``TOL * max|expected|`` with TOL = 1e-6 (measured: up to ~3e-7).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from nanoexp.model.placement import local_slice, placement
from nanoexp.parallel.context import Axis, ParallelContext
from nanoexp.parallel.layout import Layout
from nanoexp.model.llama import LlamaForCausalLM, LlamaShape
from nanoexp.model.moe import MoeShape
from nanoexp.parallel.tensor_parallel import (
    ColumnInput, ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, column_input,
    vocab_parallel_cross_entropy)
from nanoexp.parallel.tensor_parallel_plan import PLAN, apply_tensor_parallel
from tests.distributed import run_distributed

B, S, H, FF, V = 2, 8, 16, 32, 64  # S, FF and V divisible by 4
TOL = 1e-6


def _close(actual, expected, what):
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    err = (actual.float() - expected.float()).abs().max().item()
    bound = TOL * max(expected.abs().max().item(), 1e-3)
    assert err <= bound, f"{what}: max error {err:.2e} > {bound:.2e}"


def _seq(axis):
    """This rank's chunk of a full [b, s, ...] tensor along the sequence."""
    return lambda t: t.chunk(axis.size, dim=1)[axis.rank]


def _last(axis):
    """This rank's shard of a full tensor along the last (feature / vocab) dim."""
    return lambda t: t.chunk(axis.size, dim=-1)[axis.rank]


def _whole(t):
    return t


class _MLP(nn.Module):
    def __init__(self, up, down):
        super().__init__()
        self.up, self.down = up, down

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


def _check_layer(axis, ref, layer, x, in_local, out_local, what):
    """Output, input grad and weight grads of `layer` on in_local(x) vs `ref` on x."""
    for p, r in zip(layer.parameters(), ref.parameters(), strict=True):
        with torch.no_grad():
            p.copy_(local_slice(r.detach(), p))
    needs_grad = x.is_floating_point()
    x_ref = x.clone().requires_grad_(needs_grad)
    y_ref = ref(x_ref)
    g = torch.randn(y_ref.shape)  # same on every rank: the caller seeded identically
    (y_ref * g).sum().backward()

    x_loc = in_local(x).clone().requires_grad_(needs_grad)
    y = layer(x_loc)
    (y * out_local(g)).sum().backward()
    _close(y, out_local(y_ref), f"{what} output")
    if needs_grad:
        _close(x_loc.grad, in_local(x_ref.grad), f"{what} input grad")
    for (name, p), r in zip(layer.named_parameters(), ref.parameters()):
        grad = p.grad
        if placement(p).sequence_parallel:  # partial per sequence chunk: sum over tp
            grad = grad.clone()
            dist.all_reduce(grad, group=axis.group)
        _close(grad, local_slice(r.grad, p), f"{what} {name} grad")


def _check_all(axis):
    seq, last = _seq(axis), _last(axis)
    for sp in (False, True):
        mode = "sp" if sp else "all-reduce"
        act = seq if sp else _whole  # layout of activations between blocks
        torch.manual_seed(0)
        x = torch.randn(B, S, H)
        _check_layer(axis, nn.Linear(H, FF, bias=True),
                     ColumnParallelLinear(H, FF, axis, bias=True, sequence_parallel=sp),
                     x, act, last, f"column {mode}")
        _check_layer(axis, nn.Linear(FF, H, bias=True),
                     RowParallelLinear(FF, H, axis, bias=True, sequence_parallel=sp),
                     torch.randn(B, S, FF), last, act, f"row {mode}")
        _check_layer(axis, _MLP(nn.Linear(H, FF, bias=False), nn.Linear(FF, H, bias=False)),
                     _MLP(ColumnParallelLinear(H, FF, axis, sequence_parallel=sp),
                          RowParallelLinear(FF, H, axis, sequence_parallel=sp)),
                     x, act, act, f"mlp {mode}")
        ids = torch.randint(0, V, (B, S))
        ids[0, :axis.size] = torch.arange(axis.size) * (V // axis.size)  # at least one id in every shard
        _check_layer(axis, nn.Embedding(V, H), VocabParallelEmbedding(V, H, axis, sequence_parallel=sp),
                     ids, _whole, act, f"embedding {mode}")

        with pytest.raises(ValueError, match="sequence parallelism needs the sequence"):
            RowParallelLinear(FF, H, axis, sequence_parallel=True)(torch.randn(B, S + 1, FF // axis.size))

    # Cross-entropy: large logits test the max shift, -100 tests ignore_index.
    torch.manual_seed(1)
    logits = (10 * torch.randn(B, S, V)).requires_grad_()
    targets = torch.randint(0, V, (B, S))
    targets[1, 0] = -100
    weights = torch.randn(B, S)  # a non-uniform upstream gradient
    ref_loss = F.cross_entropy(logits.view(-1, V), targets.view(-1), reduction="none").view(B, S)
    (ref_loss * weights).sum().backward()
    local = last(logits.detach()).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets, axis)
    (loss * weights).sum().backward()
    assert loss.dtype == torch.float32
    _close(loss, ref_loss, "cross-entropy loss")
    _close(local.grad, last(logits.grad), "cross-entropy logits grad")

    # bf16 autocast: runs, communicates bf16, stays near float32 (bf16 has ~3 significant digits).
    mlp = _MLP(ColumnParallelLinear(H, FF, axis, sequence_parallel=True),
               RowParallelLinear(FF, H, axis, sequence_parallel=True))
    for p in mlp.parameters():
        nn.init.normal_(p, std=0.1)
    x = torch.randn(B, S // axis.size, H, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mlp(x)
        lp = vocab_parallel_cross_entropy(local.detach().bfloat16().requires_grad_(), targets, axis)
    assert y.dtype == torch.bfloat16 and lp.dtype == torch.float32
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and torch.isfinite(x.grad).all()
    assert (lp - ref_loss.detach()).abs().max() < 0.1 * ref_loss.abs().max()
    return True


def _tp_worker(rank, world_size, layouts):
    for dp, tp in layouts:
        _check_all(ParallelContext(Layout(dp=dp, tp=tp)).axis("tp"))
    return True


@pytest.mark.parametrize("world_size, layouts", [(2, [(1, 2)]), (4, [(1, 4), (2, 2)])])
def test_tensor_parallel_matches_reference(world_size, layouts):
    assert all(run_distributed(_tp_worker, world_size, layouts))


def test_tp1_is_plain_pytorch():
    axis = Axis()
    torch.manual_seed(0)
    x = torch.randn(B, S, H)
    col, row = ColumnParallelLinear(H, FF, axis, bias=True), RowParallelLinear(FF, H, axis, bias=True)
    emb = VocabParallelEmbedding(V, H, axis)
    for p in [*col.parameters(), *row.parameters(), *emb.parameters()]:
        nn.init.normal_(p)
    assert torch.equal(col(x), F.linear(x, col.weight, col.bias))
    h = torch.randn(B, S, FF)
    assert torch.equal(row(h), F.linear(h, row.weight, row.bias))
    ids = torch.randint(0, V, (B, S))
    assert torch.equal(emb(ids), F.embedding(ids, emb.weight))
    logits, targets = torch.randn(B, S, V), torch.randint(0, V, (B, S))
    expected = F.cross_entropy(logits.view(-1, V), targets.view(-1), reduction="none").view(B, S)
    assert torch.equal(vocab_parallel_cross_entropy(logits, targets, axis), expected)
    for sequence_parallel in (False, True):
        assert column_input(x, axis, sequence_parallel) is x  # no communication, no copy
    assert local_slice(x, col.weight) is x
    assert placement(col.weight).split_dim == 0 and placement(row.weight).split_dim == 1
    assert placement(row.bias).split_dim is None and placement(emb.weight).split_dim == 0


def test_sizes_must_divide_tp():
    fake_tp2 = Axis(group=None, size=2, rank=0)  # constructors communicate nothing
    with pytest.raises(ValueError, match="out_features"):
        ColumnParallelLinear(H, FF + 1, fake_tp2)
    with pytest.raises(ValueError, match="in_features"):
        RowParallelLinear(FF + 1, H, fake_tp2)
    with pytest.raises(ValueError, match="vocab_size"):
        VocabParallelEmbedding(V + 1, H, fake_tp2)


def _plain_model(layer_frequency: int) -> LlamaForCausalLM:
    moe = MoeShape(num_experts=4, top_k=2, intermediate_size=FF, num_shared_experts=1, layer_frequency=layer_frequency)
    shape = LlamaShape(hidden_size=H, intermediate_size=FF, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=V, max_position_embeddings=S, moe=moe)
    with torch.device("meta"):
        return LlamaForCausalLM(shape)


def test_the_plan_splits_the_layers_it_names_by_path():
    """Layer 0 dense, layer 1 MoE: each named layer becomes its tp version, nothing else does (the MoE block's
    shared experts stay whole); a model whose every layer is MoE has no MLP entry to match."""
    model = apply_tensor_parallel(_plain_model(layer_frequency=2), Axis(size=2), sequence_parallel=True)
    styles = {path: type(module) for path, module in model.named_modules()
              if isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, ColumnInput))}
    layer, attn = "model.layers.{}.", "model.layers.{}.self_attn."
    expected = {"model.embed_tokens": VocabParallelEmbedding, "lm_head": ColumnParallelLinear,
                layer.format(0) + "mlp.mlp_input": ColumnInput, layer.format(0) + "mlp.down_proj": RowParallelLinear,
                **{layer.format(0) + f"mlp.{name}": ColumnParallelLinear for name in ("gate_proj", "up_proj")}}
    for n in (0, 1):
        expected.update({attn.format(n) + "qkv_input": ColumnInput, attn.format(n) + "o_proj": RowParallelLinear,
                         **{attn.format(n) + f"{x}_proj": ColumnParallelLinear for x in "qkv"}})
    assert styles == expected
    assert model.model.layers["1"].self_attn.heads == 2 and model.model.layers["1"].self_attn.kv_heads == 1
    apply_tensor_parallel(_plain_model(layer_frequency=1), Axis(size=2), sequence_parallel=False)


def test_a_plan_entry_that_matches_no_module_is_refused(monkeypatch):
    """A layer renamed in the model but not in the plan would stay whole on every rank: refused, naming the entry."""
    monkeypatch.setitem(PLAN, "model.layers.*.self_attn.qkv_proj", "column")
    with pytest.raises(ValueError, match=r"'model\.layers\.\*\.self_attn\.qkv_proj' matches no module"):
        apply_tensor_parallel(_plain_model(layer_frequency=2), Axis(size=2), sequence_parallel=False)
