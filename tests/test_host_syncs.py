"""Host waits per training step, counted on CPU (nanoexp/verify/host_syncs.py): the calls that would make the host
wait for a GPU. A step reads its scalars (loss, gradient norm, MoE metrics, the stop flag) once; a MoE layer reads
its split sizes once per micro-batch; nothing else in nanoexp's own code reads the device."""
import os

from nanoexp.parallel.context import ParallelContext
from nanoexp.parallel.layout import Layout
from nanoexp.run import check_config
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


def test_a_moe_layer_reads_its_split_sizes_once_a_micro_batch(tmp_path):
    cfg = compose_config(["model=moe_tiny"])
    layers, frequency = cfg.model.model_config.num_hidden_layers, cfg.model.moe.layer_frequency
    moe_layers = sum((n + 1) % frequency == 0 for n in range(layers))
    micro_batches = cfg.tokens.global_batch_size // cfg.tokens.micro_batch_size
    syncs = waits(tmp_path, ["model=moe_tiny"])
    assert syncs.count == 1 + moe_layers * micro_batches, syncs.by_site
    assert sum(n for site, n in syncs.by_site.items() if site.startswith("nanoexp/model/moe.py")) == \
        moe_layers * micro_batches


def _pipeline_rank(rank, world_size, run_dir):
    return dict(waits(os.path.join(run_dir), ["model=tiny", "parallelism=dp1tp1pp2"], world_size).by_site)


def test_a_pipeline_step_reads_the_device_once_on_each_rank(tmp_path):
    by_rank = run_distributed(_pipeline_rank, 2, str(tmp_path))
    assert [sum(sites.values()) for sites in by_rank] == [1, 1], by_rank
