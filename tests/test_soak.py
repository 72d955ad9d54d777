"""Soak: long runs keep resident memory flat and leave no stray processes or open ports."""
import os

import psutil

from tests.helpers import train

# A model so small that a step costs a few milliseconds: thousands of steps in seconds.
MICRO = ["model.model_config.hidden_size=32", "model.model_config.intermediate_size=64",
         "model.model_config.num_hidden_layers=2", "model.model_config.num_attention_heads=2",
         "model.model_config.num_key_value_heads=2", "tokens.sequence_length=16", "tokens.global_batch_size=4",
         "tokens.micro_batch_size=2", "tokens.limit_val_batches=1", "tokens.val_check_interval=0",
         "logging.tensorboard=false", "logging.iteration_step_info_interval=50",
         "optimizer.learning_rate_scheduler.lr_warmup_steps=10", "checkpoint.save_final_state=false"]
# RSS may wobble by allocator caching; a leak of even 1 KB per step would exceed this over the run.
GROWTH_BOUND_MB = 25.0


def our_ports() -> set:
    return {c.laddr for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}


def assert_flat_memory(records, after_step):
    rss = [r["peak_memory_mb"] for r in records if "loss" in r and r["step"] >= after_step]
    assert len(rss) >= 5
    assert max(rss) - rss[0] < GROWTH_BOUND_MB, rss


def test_single_process_soak(tmp_path):
    ports_before = our_ports()
    records = train(tmp_path, MICRO + ["tokens.train_steps=3000"])
    assert_flat_memory(records, after_step=300)
    assert our_ports() == ports_before


def test_multi_process_soak_leaves_nothing_behind(tmp_path):
    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    ports_before = our_ports()
    records = train(tmp_path, MICRO + ["tokens.train_steps=600", "parallelism=dp2tp1pp1"])
    assert_flat_memory(records, after_step=100)
    leftover = [p for p in psutil.Process().children(recursive=True)
                if p.pid not in children_before and p.status() != psutil.STATUS_ZOMBIE]
    assert not leftover, [p.cmdline() for p in leftover]
    assert our_ports() == ports_before
    assert os.path.exists(tmp_path / "summary.json")
