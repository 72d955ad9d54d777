"""The fine-grained, Qwen3-MoE-shaped group (conf/model/qwen3_moe_*): q/k norms on every layout, and a Hugging Face
round trip through the scripts with transformers' Qwen3MoeForCausalLM (logits within the Llama export's bound,
weights back bit for bit, and loaded straight from the HF folder on an expert-parallel layout)."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from nanoexp.interop.hf import load_hf_weights
from nanoexp.parallel.context import ParallelContext
from nanoexp.parallel.layout import Layout
from nanoexp.runtime.build import build_model, load_single_process
from tests.distributed import run_distributed
from tests.helpers import FAST, compose_config, tiered, train
from tests.test_checkpoint import ROOT
from tests.test_hf_conversion import LOGITS_ATOL
from tests.test_moe import GRAD_NORM_RTOL, STEPS, moe_curves
from tests.test_parallel import LATER_STEP_ATOL

QWEN3 = ["model=qwen3_moe_tiny"]   # on FAST's shape: hidden 64, 4 heads of 16, 4 layers of 32 experts of width 72
EP2 = ["parallelism.ep=2"]
LAYOUTS = {   # q/k norms see each tp rank's heads: their gradients are summed over tp, with or without SP
    "ep2tp2": ["parallelism=dp2tp2pp1"] + EP2,
    "tp2-reduce_scatter": ["parallelism=dp1tp2pp1", "parallelism.tp_mode=reduce_scatter"],
    "ep2cp2-pp2": ["parallelism=dp1cp2tp1pp2"] + EP2,
}


@pytest.mark.slow
@pytest.mark.parametrize("name", tiered(LAYOUTS, quick=["ep2tp2"]))
def test_layout_trains_the_one_process_fine_grained_model(name, train_once, tmp_path):
    ours = moe_curves(train(tmp_path, FAST + QWEN3 + STEPS + LAYOUTS[name]), layers=range(4))
    expected = moe_curves(train_once(FAST + QWEN3 + STEPS)[1], layers=range(4))
    np.testing.assert_allclose(ours["loss"], expected["loss"], atol=LATER_STEP_ATOL, rtol=0)
    np.testing.assert_allclose(ours["grad_norm"], expected["grad_norm"], rtol=GRAD_NORM_RTOL)
    for layer in range(4):
        key = f"moe_load_imbalance/layer_{layer}"
        np.testing.assert_allclose(ours[key], expected[key], atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory):
    """Trained 2 steps on ep2 x pp2, exported by scripts/convert_to_hf.py, imported back by
    scripts/convert_from_hf.py."""
    root = tmp_path_factory.mktemp("qwen3")
    train(root / "run", FAST + QWEN3 + ["tokens.train_steps=2", "tokens.val_check_interval=0",
                                         "parallelism=dp2tp1pp2"] + EP2)
    ckpt, hf_dir = root / "run" / "checkpoints" / "2", root / "hf"
    for script, args in (("convert_to_hf.py", [ckpt, hf_dir]), ("convert_from_hf.py", [hf_dir, root / "back"])):
        subprocess.run([sys.executable, f"scripts/{script}", *map(str, args)], cwd=ROOT, check=True,
                       capture_output=True)
    return load_single_process(str(ckpt))[0], hf_dir, root / "back" / "0"


@pytest.mark.slow
def test_transformers_qwen3_moe_gives_our_logits(round_trip):
    from transformers import Qwen3MoeForCausalLM
    ours, hf_dir, _ = round_trip
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["num_experts"] == 32 and config["norm_topk_prob"]
    hf = Qwen3MoeForCausalLM.from_pretrained(str(hf_dir)).eval()
    ids = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(input_ids=ids), atol=LOGITS_ATOL, rtol=0)


def test_imported_weights_are_the_exported_ones(round_trip):
    ours, _, back = round_trip
    imported, cfg = load_single_process(str(back))
    assert cfg.model.model_config.qk_norm and cfg.model.moe.num_experts == 32
    for (name, p), (name_back, q) in zip(ours.named_parameters(), imported.named_parameters()):
        assert name == name_back and torch.equal(p, q), name


def _load_on_ep2(rank, world_size, hf_dir):
    cfg = compose_config(FAST + QWEN3 + ["parallelism=dp2tp1pp1"] + EP2)
    model = build_model(cfg, ParallelContext(Layout(dp=2, ep=2)))
    load_hf_weights(model, hf_dir)
    return {n: p.detach() for n, p in model.named_parameters()}


def test_an_expert_parallel_rank_loads_its_experts_from_the_hf_folder(round_trip):
    ours, hf_dir, _ = round_trip
    ranks = run_distributed(_load_on_ep2, 2, str(hf_dir))
    for name, param in ours.named_parameters():
        if ".experts." in name:   # 16 of the 32 experts on each rank
            joined = torch.cat([torch.from_numpy(rank[name]) for rank in ranks])
        else:
            joined = torch.from_numpy(ranks[1][name])
        assert torch.equal(joined, param.detach()), name
