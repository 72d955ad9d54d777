"""parallelism.recompute (none | full | selective | every_k) and offload_activations (runtime/recompute.py): every
mode trains the model of `none` (one process: the same gradients, bit for bit; each layout: within test_parallel's
first-step tolerances), recomputes exactly the ops it should (counted by a dispatch mode), keeps what the memory
estimate says (counted from the tensors), and a bad setting stops at start-up with one line naming the key."""
from __future__ import annotations

import collections
import json

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nanoexp.instruments.memory import LiveTensorPeak
from nanoexp.model.shape import model_shape
from nanoexp.observe.memory_estimate import estimate
from nanoexp.parallel.context import ParallelContext
from nanoexp.parallel.layout import Layout
from nanoexp.runtime.build import build_model
from nanoexp.runtime.recompute import RecomputePolicy, apply_recompute
from tests.distributed import run_distributed
from tests.helpers import FAST, SLOW, compose_config, tiered, train_py
from tests.test_parallel import _first_step, assert_same_first_step

MODES = {"full": ["parallelism.recompute=full"], "selective": ["parallelism.recompute=selective"],
         "every_k": ["parallelism.recompute=every_k"],
         "selective-attention": ["parallelism.recompute=selective", "parallelism.selective_ops=[attention]"],
         "nanotron-recompute_layer": ["parallelism.recompute_layer=true"]}


class OpCounter(TorchDispatchMode):
    """How many times each aten op ran inside the block."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def step(overrides, model=None, counted=False):
    """(gradients by name, ops the backward ran) of one forward and backward of FAST's model on a fixed batch."""
    cfg = compose_config(FAST + overrides)
    model = model or build_model(cfg, ParallelContext())
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).mean()
    with OpCounter() if counted else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t) as counter:
        loss.backward()
    return {name: p.grad for name, p in model.named_parameters()}, getattr(counter, "counts", None)


@pytest.fixture(scope="module")
def plain():
    return step([], counted=True)


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_gives_the_gradients_of_none_bit_for_bit(mode, plain):
    # recomputation repeats the same float32 ops on the same inputs, in the same order
    grads, _ = step(MODES[mode])
    assert all(torch.equal(grads[name], plain[0][name]) for name in plain[0])


@pytest.mark.parametrize("overrides", [["model.fp8.enabled=true"], pytest.param(["model.compile=true"], marks=SLOW)],
                         ids=["fp8", "compile"])
def test_modes_under_a_number_format_and_compile(overrides):
    """FP8 casts recompute to the same scales; compile traces the checkpoint with the layer and partitions by the
    same policy. Measured: bit-identical in both (2026-12-07); the bar is test_parallel's first-step tolerance
    (relative 1e-4 of each gradient's scale), as a compiled backward may fuse the recomputed ops otherwise."""
    reference, _ = step(overrides)
    for mode in ("full", "selective", "every_k"):
        grads, _ = step(overrides + MODES[mode])
        for name, grad in reference.items():
            torch.testing.assert_close(grads[name], grad, atol=1e-4 * grad.abs().max().item() + 1e-8, rtol=0)


def recomputed(counts, plain_counts) -> dict[str, int]:
    """The ops a backward ran beyond the plain backward's: what it recomputed."""
    return {op: n - plain_counts.get(op, 0) for op, n in counts.items() if n != plain_counts.get(op, 0)}


def test_selective_recomputes_no_matmul_and_no_attention(plain):
    """FAST: 4 layers, 7 products each (q, k, v, o, gate, up, down). full reruns every layer's forward but its down
    projection (checkpoint stops once every saved tensor is back: 6 products and the attention a layer); selective
    keeps the products and attention and reruns only the norms (2 a layer) and SwiGLU's silu; every_k (k = 2)
    reruns layers 1 and 3 whole; selective keeping attention only reruns the 6 products, not the attention."""
    extra = {mode: recomputed(step(MODES[mode], counted=True)[1], plain[1]) for mode in MODES}
    sdpa = "_scaled_dot_product_flash_attention_for_cpu"
    assert extra["full"]["mm"] == 4 * 6 and extra["full"][sdpa] == 4 and extra["full"]["silu"] == 4
    assert extra["nanotron-recompute_layer"] == extra["full"]
    assert "mm" not in extra["selective"] and sdpa not in extra["selective"]
    assert extra["selective"]["rsqrt"] == 4 * 2 and extra["selective"]["silu"] == 4
    assert extra["every_k"]["mm"] == 2 * 6 and extra["every_k"][sdpa] == 2
    assert extra["selective-attention"]["mm"] == 4 * 6 and sdpa not in extra["selective-attention"]


def test_offload_moves_the_saved_tensors_and_brings_them_back_exactly(plain):
    """The offload's mechanism on a CPU (no streams, plain copies; a CUDA run adds pinned memory and its own
    stream): every saved tensor of a layer that is not recomputed leaves as a copy and comes back equal; every_k
    recomputes layers 1 and 3, which save nothing through the hooks (checkpoint holds their inputs itself)."""
    for policy, offloaded_layers in ((RecomputePolicy("none", offload=True), {0, 1, 2, 3}),
                                     (RecomputePolicy("every_k", offload=True), {0, 2})):
        model = build_model(compose_config(FAST), ParallelContext())
        apply_recompute(model, policy, torch.device("cpu"))
        offloads = {layer.forward.offload for layer in model.model.layers.values() if hasattr(layer.forward, "offload")}
        (offload,) = offloads
        packed = []
        pack = offload.pack
        offload.pack = lambda group, tensor: packed.append(group.layer) or pack(group, tensor)
        grads, _ = step([], model)
        assert set(packed) == offloaded_layers
        assert all(torch.equal(grads[name], plain[0][name]) for name in plain[0])


# model=small (one process) and medium: LiveTensorPeak counts the tensors one micro-batch of 4 x 128 creates
# (parameter gradients allocated before), against the estimate's activations. Measured 2026-12-07 (est / measured):
# small none 1.02, full 1.09, selective 1.06, every_k 1.03, selective keeping attention only 1.08; medium in the
# same range (docs/memory.md's table); tp2 and pp2 1.0-1.12.
@pytest.mark.parametrize("model", ["small", pytest.param("medium", marks=SLOW)])
@pytest.mark.parametrize("mode", ["none", "full", "selective", "every_k", "selective-attention"])
def test_estimate_knows_each_mode_within_15_percent(model, mode):
    measured, estimated = measured_activations([f"model={model}"] + MODES.get(mode, []))
    assert 0.85 <= estimated / measured <= 1.15, (measured, estimated)


def measured_activations(overrides) -> tuple[float, float]:
    """(peak bytes of the tensors one micro-batch's forward and backward create, the estimate's activations)."""
    cfg = compose_config(overrides)
    ctx = ParallelContext(Layout.from_config(cfg)) if torch.distributed.is_initialized() else ParallelContext()
    model = build_model(cfg, ctx)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    ids = torch.randint(0, 257, (cfg.tokens.micro_batch_size, cfg.tokens.sequence_length),
                        generator=torch.Generator().manual_seed(0))
    with LiveTensorPeak() as live:
        model(input_ids=ids, labels=ids).mean().backward()
    return live.peak, estimate(cfg, model_shape(cfg), 0)["activations"]


def _tp2_measured(rank, world, overrides):
    return measured_activations(overrides + ["parallelism.tp=2"])


@SLOW
@pytest.mark.parametrize("mode", ["none", "full", "selective"])
@pytest.mark.parametrize("tp_mode", ["all_reduce", "reduce_scatter"])
def test_estimate_knows_each_mode_under_tensor_parallelism(mode, tp_mode):
    for measured, estimated in run_distributed(_tp2_measured, 2, ["model=small", f"parallelism.tp_mode={tp_mode}"]
                                               + MODES.get(mode, [])):
        assert 0.85 <= estimated / measured <= 1.15, (measured, estimated)


# The layouts of the parity table (docs/memory.md): each mode's first step against one process's without
# recomputation, stitched from every rank (test_parallel's machinery and tolerances).
LAYOUTS = {
    "tp2-sp": ["parallelism=dp1tp2pp1", "parallelism.tp_mode=reduce_scatter"],
    "pp2-zbv": ["parallelism=dp1tp1pp2", "parallelism.pp_engine=zbv", "parallelism.pp_virtual_stages=2"],
    "cp2-ring": ["parallelism=dp1cp2tp1pp1"],
    "ep2": ["model=moe_tiny", "parallelism=dp2tp1pp1", "parallelism.ep=2"],
    "zero3": ["parallelism=dp2tp1pp1", "optimizer.zero_stage=3"],
}
CASES = {f"{layout}-{mode}": (layout, mode) for layout in LAYOUTS for mode in ("full", "selective", "every_k")}


@pytest.mark.parametrize("name", tiered(CASES, quick=["tp2-sp-selective"]))
def test_each_mode_on_a_layout_gives_the_first_step_of_one_process(name):
    layout, mode = CASES[name]
    model = [o for o in LAYOUTS[layout] if o.startswith("model=")]
    (expected,) = run_distributed(_first_step, 1, ["parallelism=dp1tp1pp1"] + model)
    overrides = LAYOUTS[layout] + MODES[mode]
    results = run_distributed(_first_step, Layout.from_config(compose_config(FAST + overrides)).world_size, overrides)
    assert_same_first_step(with_whole_experts(results), expected)


def with_whole_experts(results):
    """ep2 over dp2: the routed experts' gradients of both dp ranks, in rank order, on rank 0 (the stitching of
    test_parallel takes dp rank 0's gradients and tp's splits)."""
    ranks = sorted(results, key=lambda r: r["dp_rank"])
    for name, (grad, dim) in ranks[0]["grads"].items():
        if ".experts." in name and ranks[1]["grads"][name][0].shape == grad.shape:
            ranks[0]["grads"][name] = (np.concatenate([r["grads"][name][0] for r in ranks]), dim)
    return results


BAD = [
    (["parallelism.recompute=sometimes"], "parallelism.recompute=sometimes: allowed values are none, full, "
                                          "selective, every_k"),
    (["parallelism.recompute=every_k", "parallelism.recompute_every=0"], "parallelism.recompute_every=0: must be >= 1"),
    (["parallelism.recompute=full", "parallelism.recompute_every=3"],
     "parallelism.recompute_every=3 has no effect here: it counts with parallelism.recompute=every_k"),
    (["parallelism.recompute=selective", "parallelism.selective_ops=[matmul,softmax]"],
     "softmax is not an op group it knows; known: matmul, attention"),
    (["parallelism.selective_ops=[attention]"], "parallelism.selective_ops=['attention'] has no effect here"),
    (["parallelism.recompute=selective", "parallelism.recompute_layer=true"],
     "parallelism.recompute_layer=true is nanotron's spelling of parallelism.recompute=full"),
    (["parallelism.offload_activations=true"], "parallelism.offload_activations=true: this run's device is the cpu"),
    (["parallelism.offload_activations=true", "parallelism.recompute=selective"],
     "parallelism.offload_activations=True has no effect here"),
]


@pytest.mark.skipif(torch.cuda.is_available(), reason="offload runs on a GPU")
@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_a_bad_setting_stops_at_start_up_naming_the_key(overrides, message, tmp_path, capsys):
    assert train_py(FAST + overrides, tmp_path) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert not (tmp_path / "metrics.jsonl").exists()


def test_nanotrons_recompute_layer_imports_as_full():
    from nanoexp.interop.nanotron import map_parallelism, Import
    for value, expected in ((True, {"recompute": "full"}), (False, {})):
        imp = Import({"parallelism": {"dp": 1, "recompute_layer": value}})
        map_parallelism(imp)
        assert {k: v for k, v in imp.out["parallelism"].items() if k.startswith("recompute")} == expected
        assert "parallelism.recompute_layer" in imp.taken


@pytest.mark.parametrize("mode", ["every_k", "selective-matmul"])
def test_hardware_flops_count_what_each_mode_reruns(mode, monkeypatch):
    """FlopCounterMode's count of a forward and backward (test_flops's math attention, whose products it sees)
    against hardware_flops_per_token: every_k reruns half the layers (all products but down, and attention);
    selective keeping the matmuls reruns only attention, here products of the math kernel, not an SDPA op."""
    from tests.test_flops import counted_flops
    from nanoexp.observe.metrics import hardware_flops_per_token
    overrides = {"every_k": MODES["every_k"],
                 "selective-matmul": ["parallelism.recompute=selective", "parallelism.selective_ops=[matmul]"]}[mode]
    counted, shape, tokens = counted_flops(overrides, monkeypatch)
    policy = RecomputePolicy.from_config(compose_config(FAST + overrides))
    assert counted == pytest.approx(hardware_flops_per_token(shape, 32, policy) * tokens, rel=1e-9)


def test_the_start_up_line_says_what_each_layer_keeps():
    assert RecomputePolicy().describe(6) is None   # the default says nothing
    assert RecomputePolicy("every_k", every=3).describe(6).startswith(
        "activations: recomputed in backward for layers 2, 5 (every 3), each keeping its input")
    assert "the outputs of its attention ops" in RecomputePolicy("selective", saved=("attention",)).describe(6)
    assert "pinned host memory" in RecomputePolicy("none", offload=True).describe(6)


# -- the planner prices and searches the modes (nanoexp/plan/) -----------------------------------------------------
def _plan_config(mode_overrides, layout=("parallelism.dp=8", "parallelism.tp=8", "parallelism.tp_mode=reduce_scatter")):
    from nanoexp.config import normalize
    cfg = compose_config(["model=llama3_70b", "tokens.sequence_length=8192", "tokens.global_batch_size=64",
                          "tokens.micro_batch_size=1", "optimizer.zero_stage=3", *layout, *mode_overrides])
    normalize(cfg)
    return cfg


def test_the_planner_prices_each_mode_between_none_and_full():
    """70B on 64 H100s as dp8 tp8 (SP, ZeRO-3): time grows none < selective < full (selective reruns no product),
    every_k between none and full; memory shrinks the other way; selective reruns the collectives full does
    (tp's in-place reductions and gathers: traffic.py), every_k half as many more."""
    from nanoexp.plan.cost import predict
    from nanoexp.plan.hardware import GPUS
    from nanoexp.plan.traffic import sent_bytes
    modes = ("none", "selective", "every_k", "full")
    cfgs = {mode: _plan_config([f"parallelism.recompute={mode}"]) for mode in modes}
    p = {mode: predict(cfg, GPUS["h100"], 8) for mode, cfg in cfgs.items()}
    assert p["none"].step_time_s < p["selective"].step_time_s < p["full"].step_time_s
    assert p["none"].step_time_s < p["every_k"].step_time_s < p["full"].step_time_s
    assert p["none"].memory_gib > p["selective"].memory_gib > p["full"].memory_gib
    assert p["none"].memory_gib > p["every_k"].memory_gib > p["full"].memory_gib
    assert [p[mode].recompute for mode in modes] == list(modes)
    assert "parallelism.recompute=selective" in p["selective"].overrides()
    tp = {mode: sent_bytes(cfg, Layout.from_config(cfg), model_shape(cfg), 0, 64)["tp"] for mode, cfg in cfgs.items()}
    assert tp["selective"] == tp["full"] > tp["none"]
    assert tp["every_k"] - tp["none"] == pytest.approx((tp["full"] - tp["none"]) / 2, rel=1e-9)


def test_the_planner_searches_the_modes_its_command_line_names(capsys):
    """Llama 3 8B on 64 H100s at 8192 tokens (1M a step): with every mode, the planner's best few include
    selective recomputation (dp64 ZeRO-3 fits with it); --json names each plan's
    mode; --recompute none,full leaves selective and every_k out; a mode it does not know is one line, exit 2."""
    from nanoexp.plan.cli import main
    args = ["model=llama3_8b", "--gpus", "64", "--seq", "8192", "--global-batch-tokens", "1048576", "--top", "5",
            "--json"]
    assert main(args) == 0
    every = json.loads(capsys.readouterr().out)
    assert "selective" in {p["recompute"] for p in every}
    assert all(f"parallelism.recompute={p['recompute']}" in p["overrides"] for p in every)
    assert main(args + ["--recompute", "none,full"]) == 0
    assert {p["recompute"] for p in json.loads(capsys.readouterr().out)} <= {"none", "full"}
    assert main(args + ["--recompute", "none,sometimes"]) == 2
    assert capsys.readouterr().err.strip() == ("plan.py: error: --recompute: 'none,sometimes': modes are none, "
                                               "selective, every_k, full, comma-separated")
