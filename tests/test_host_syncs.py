"""Host waits per training step, counted on CPU (nanoexp/verify/host_syncs.py): the calls that would make the host
wait for a GPU. A step reads its scalars (loss, gradient norm, MoE metrics, the stop flag) once; a MoE layer reads
its split sizes at most once per micro-batch (the grouped kernel, dropless on one rank: never); nothing else in
nanoexp's own code reads the device."""
import os

import pytest

from nanoexp.parallel.context import ParallelContext
from nanoexp.parallel.layout import Layout
from nanoexp.checks import check_config
from nanoexp.verify.host_syncs import host_waits_of_a_step
from tests.distributed import run_distributed
from tests.helpers import compose_config

RUN = ["tokens.train_steps=4", "optimizer.learning_rate_scheduler.lr_warmup_steps=1", "tokens.val_check_interval=0",
       "checkpoint.save_final_state=false", "logging.tensorboard=false", "data.prefetch=false"]


def waits(tmp_path, overrides, world_size=1):
    cfg = compose_config(RUN + overrides)
    check_config(cfg, world_size)
    return host_waits_of_a_step(cfg, ParallelContext(Layout.from_config(cfg)), str(tmp_path))


def test_a_dense_step_reads_the_device_once(tmp_path):
    syncs = waits(tmp_path, ["model=tiny"])
    assert syncs.count == 1 and list(syncs.by_site)[0].startswith("nanoexp/runtime/trainer.py"), syncs.by_site


def moe_syncs(tmp_path, overrides, world_size=1):
    """(syncs in the MoE layer, its kernel and its exchange, MoE layers x micro-batches, every sync) of a moe_tiny
    step."""
    cfg = compose_config(["model=moe_tiny"] + overrides)
    layers, frequency = cfg.model.model_config.num_hidden_layers, cfg.model.moe.layer_frequency
    moe_layers = sum((n + 1) % frequency == 0 for n in range(layers))
    micro_batches = cfg.tokens.global_batch_size // cfg.tokens.micro_batch_size // cfg.parallelism.dp
    syncs = waits(tmp_path, ["model=moe_tiny"] + overrides, world_size)
    in_layers = sum(n for site, n in syncs.by_site.items() if site.startswith(
        ("nanoexp/model/moe.py", "nanoexp/model/experts.py", "nanoexp/parallel/expert_parallel.py")))
    return in_layers, moe_layers * micro_batches, syncs


@pytest.mark.slow
@pytest.mark.parametrize("overrides, per_layer", [([], 0), (["model.moe.expert_kernel=loop"], 1),
                                                  (["model.moe.capacity_factor=1.0"], 1),
                                                  (["model.moe.capacity_factor=1.0", "model.moe.expert_kernel=loop"], 1)],
                         ids=["grouped_mm", "loop", "grouped_mm-capacity", "loop-capacity"])
def test_a_moe_layer_reads_its_split_sizes_at_most_once_a_micro_batch(tmp_path, overrides, per_layer):
    """Dropless, the grouped kernel's group ends are the counts' running sum on the device: nothing is read; the
    loop splits its rows by the counts, a capacity counts the kept rows: one read, shared by both."""
    in_layers, layer_passes, syncs = moe_syncs(tmp_path, overrides)
    assert in_layers == per_layer * layer_passes and syncs.count == 1 + in_layers, syncs.by_site


def _expert_parallel_rank(rank, world_size, run_dir):
    in_layers, layer_passes, _ = moe_syncs(os.path.join(run_dir), ["parallelism=dp2tp1pp1", "parallelism.ep=2"],
                                           world_size)
    return in_layers, layer_passes


def test_an_expert_parallel_layer_reads_the_exchanges_counts_once_and_the_kernel_nothing_more(tmp_path):
    """The exchange reads the counts it sends and receives once; the grouped kernel takes its ends from them."""
    assert all(in_layers == passes for in_layers, passes in run_distributed(_expert_parallel_rank, 2, str(tmp_path)))


def _pipeline_rank(rank, world_size, run_dir):
    return dict(waits(os.path.join(run_dir), ["model=tiny", "parallelism=dp1tp1pp2"], world_size).by_site)


def test_a_pipeline_step_reads_the_device_once_on_each_rank(tmp_path):
    by_rank = run_distributed(_pipeline_rank, 2, str(tmp_path))
    assert [sum(sites.values()) for sites in by_rank] == [1, 1], by_rank
