"""What a GPU run needs that a CPU can check: which GPU a local rank takes, NCCL's ways of saying a peer is
lost, TF32 for float32 runs on CUDA, and grouped K/V heads repeated where SDPA would fall back to its math kernel."""
import pytest
import torch

from nanoexp.launch.workers import WorkerFailed, gpu_index, lost_peer
from nanoexp.model.attention import SDPA, Causal, Documents, native_gqa
from nanoexp.numerics.precision import tf32_enabled
from nanoexp.observe.peak import peak_dtype
from tests.helpers import compose_config

CUDA = torch.device("cuda", 0)   # only its type is read: no GPU needed


def test_a_local_rank_takes_its_own_gpu_or_says_why_it_has_none():
    assert [gpu_index(r, 4, visible=4, env={}) for r in range(4)] == [0, 1, 2, 3]
    assert gpu_index(3, 4, visible=1, env={"SLURM_STEP_GPUS": "3"}) == 0   # SLURM bound one GPU to this task
    with pytest.raises(WorkerFailed, match=r"local rank 2 of 4 ranks on this node has no GPU: 2 visible "
                                           r"\(CUDA_VISIBLE_DEVICES=0,1\); run at most 2 ranks per node"):
        gpu_index(2, 4, visible=2, env={"CUDA_VISIBLE_DEVICES": "0,1"})


def test_nccl_lost_peers_and_timeouts_become_the_one_line_report():
    """NCCL's texts (from its error and watchdog messages): a lost peer names no host; a timeout is a timeout."""
    remote = RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network "
                          "error, NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a network error")
    assert lost_peer(remote, 600).startswith("lost contact with a peer (NCCL")
    watchdog = RuntimeError("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, "
                            "OpType=ALLREDUCE, NumelIn=1, Timeout(ms)=600000) ran for 600051 milliseconds before "
                            "timing out.")
    assert "parallelism.collective_timeout_s=600 s" in lost_peer(watchdog, 600)


def test_tf32_is_on_for_float32_on_cuda_unless_turned_off():
    cfg = compose_config([])
    assert tf32_enabled(cfg, CUDA) and not tf32_enabled(cfg, torch.device("cpu"))
    assert peak_dtype(cfg, CUDA) == "tfloat32" and peak_dtype(cfg, torch.device("cpu")) == "float32"
    assert not tf32_enabled(compose_config(["model.allow_tf32=false"]), CUDA)
    assert peak_dtype(compose_config(["model.dtype=bfloat16"]), CUDA) == "bfloat16"


@pytest.mark.parametrize("mask", ["documents", "cache"])
def test_grouped_heads_are_repeated_where_cuda_would_fall_back_to_the_math_kernel(mask, monkeypatch):
    """With a mask (or in float32) on CUDA, SDPA gets K/V repeated instead of enable_gqa: here the decision is
    made as on CUDA, and the result is SDPA's on K/V repeated by hand, exactly."""
    import nanoexp.model.attention as attention
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 16, 4, generator=gen)
    k, v = (torch.randn(2, 2, 16, 4, generator=gen) for _ in range(2))
    positions = torch.arange(16)
    if mask == "documents":
        chosen = Documents((positions // 5)[None].expand(2, -1), (positions % 5)[None].expand(2, -1))
    else:
        q, chosen = q[:, :, -4:], Causal(offset=12)   # 4 new queries over 16 cached keys
    decisions = []
    monkeypatch.setattr(attention, "native_gqa", lambda q, masked: decisions.append(masked) or False)
    ours = SDPA()(q, k, v, None, chosen)
    reference = SDPA()(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), None, chosen)   # no GQA left
    assert decisions == [True]   # asked once (the reference has no grouped heads), as a masked call
    torch.testing.assert_close(ours, reference, rtol=0, atol=0)


def test_which_calls_take_grouped_heads_as_they_are():
    q = torch.randn(1, 8, 4, 4)
    assert native_gqa(q, masked=True) and native_gqa(q, masked=False)   # CPU's fused kernel takes both
