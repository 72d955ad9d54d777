"""The memory check at start (nanoexp/checks.py check_memory): a run whose memory estimate exceeds the machine's
memory is refused in one line before anything is allocated, host memory on CPU, the GPU's on CUDA; the shipped runs
are not; general.check_memory=false lets a run start all the same. The machine's memory is set by each test (a CI
machine's may be far larger than the 23 GiB this was found on), so no verdict depends on it."""
from types import SimpleNamespace

import psutil
import pytest
import torch

from nanoexp import checks
from nanoexp.config import ConfigError, normalize
from tests.helpers import compose_config, train_py

GIB = 2**30
BIG = ["model.model_config.hidden_size=16384"]   # ~4.4 G parameters: 81.3 GiB of float32 state and AdamW moments


def host_with(monkeypatch, gib: float) -> None:
    monkeypatch.setattr(checks.psutil, "virtual_memory", lambda: SimpleNamespace(available=gib * GIB))


def gpu_of(monkeypatch, gib: float, name: str = "NVIDIA H100 80GB HBM3") -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(total_memory=gib * GIB, name=name))


def checked(overrides: list[str]):
    cfg = compose_config(overrides)
    normalize(cfg)
    checks.check_memory(cfg)


def test_a_model_far_beyond_host_memory_is_refused_before_any_allocation(monkeypatch, tmp_path, capsys):
    host_with(monkeypatch, 23)
    rss = psutil.Process().memory_info().rss
    assert train_py(BIG, tmp_path / "run") == 2
    assert capsys.readouterr().err == (
        "nanoexp: general.check_memory: the memory estimate of this run is 81.3 GiB for its 1 rank(s) on this machine, "
        "above the 23.0 GiB of host memory available now (scripts/estimate_memory.py itemises it): use a smaller "
        "model or micro-batch, shard it (optimizer.zero_stage, parallelism.*), or set general.check_memory=false to "
        "start anyway\n")
    assert psutil.Process().memory_info().rss - rss < GIB   # its 16 GiB of weights were never allocated
    assert not (tmp_path / "run").exists()


def test_the_ranks_of_a_machine_share_its_memory(monkeypatch):
    """The local ranks' estimates add up (each pipeline stage's times its ranks): dp2 needs twice dp1's."""
    host_with(monkeypatch, 1)
    needs = {}
    for layout, ranks in (("dp1tp1pp1", 1), ("dp2tp1pp1", 2), ("dp2tp1pp2", 4)):
        with pytest.raises(ConfigError, match=rf"for its {ranks} rank\(s\)") as error:
            checked([f"parallelism={layout}", "model=llama_1b"])
        needs[layout] = float(str(error.value).split("this run is ")[1].split(" GiB")[0])
    assert needs["dp2tp1pp1"] == pytest.approx(2 * needs["dp1tp1pp1"], abs=0.1)


@pytest.mark.parametrize("overrides", [[], ["debug=fast"], ["model=small"], ["parallelism=dp2tp2pp2"],
                                       ["parallelism=dp2tp1pp1", "optimizer.zero_stage=3"],
                                       ["model=moe_tiny", "parallelism=dp2tp1pp1", "parallelism.ep=2"]])
def test_the_shipped_runs_are_not_refused_even_on_a_small_machine(overrides, monkeypatch):
    """A few hundred MB at most: they start with 2 GiB free, and on this machine as it is."""
    checked(overrides)
    host_with(monkeypatch, 2)
    checked(overrides)


def test_on_gpus_each_rank_is_checked_against_its_gpu(monkeypatch):
    """The busiest rank's estimate as the layout planner counts it (bf16 weight copies, the CUDA context) against
    the smallest GPU: Llama 1B on dp1 fits an 80 GB H100 (about 25 GiB), not a 16 GiB card; the BIG model fits
    neither until ZeRO-3 spreads it over 8 GPUs."""
    gpu_of(monkeypatch, 79.2)
    checked(["model=llama_1b", "model.dtype=bfloat16"])
    with pytest.raises(ConfigError, match=r"GiB per GPU, above the 79.2 GiB of NVIDIA H100 80GB HBM3 "):
        checked(BIG)
    checked(BIG + ["parallelism.dp=8", "optimizer.zero_stage=3"])
    gpu_of(monkeypatch, 16, "NVIDIA T4")
    with pytest.raises(ConfigError, match=r"per GPU, above the 16.0 GiB of NVIDIA T4 "):
        checked(["model=llama_1b", "model.dtype=bfloat16"])


def test_forked_local_workers_are_not_checked_on_gpus(monkeypatch):
    """Asking CUDA in the launcher would keep forked workers from using it: with start_method=fork it is not asked,
    and the run is not checked (not against the host's memory either: its tensors live on the GPUs)."""
    gpu_of(monkeypatch, 16)
    host_with(monkeypatch, 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: pytest.fail("CUDA asked before a fork"))
    checked(BIG + ["parallelism.start_method=fork"])


def test_the_check_can_be_turned_off(monkeypatch):
    host_with(monkeypatch, 23)
    checked(BIG + ["general.check_memory=false"])
    with pytest.raises(ConfigError, match="general.check_memory=false to start anyway"):
        checked(BIG)
