"""Replica groups with torchft, trained for real: R = 2 groups on this machine (a lighthouse and two group processes
started by `train.py fault_tolerance=torchft`), each against the plain run of the same global batch (dp = 2 x the
group's dp), and through a failure (one group's rank SIGKILLed in a step).

Tolerances: a group averages its gradients over its dp ranks and then over the live groups, where the plain run
averages over all of them at once, so the float32 sums differ in order: about 1e-7 relative a step, which AdamW at
these learning rates carries into the loss at most ~1e-6 in 4-6 steps (measured: equal to the last bit on this
CPU); the tests allow rtol 1e-5 on losses and atol 1e-5 on weights, far below a wrong batch (~1e-2)."""
import importlib.util
import json
import os

import pytest
import torch

from nanoexp.checkpoint.load import CheckpointReader
from tests.helpers import FAST, read_metrics, train, train_losses

# Every test here starts replica groups (about 10-30 s each on 2 cores). torchft is part of .[dev]; it is not imported
# here, so that nanoexp quiets its logs when it first loads it.
pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("torchft") is None and
                                                   os.environ.get("CI") != "true", reason="pip install -e '.[ft]'")]

BASE = FAST + ["tokens.val_check_interval=0", "checkpoint.checkpoint_interval=0"]
TORCHFT = ["fault_tolerance=torchft"]
# the plain layout, each group's layout (2 groups: the same dp x cp x tp x pp ranks in all), extra keys. The
# gradient path's three kinds of final gradients: whole buffers (dp2), a pipeline stage's (pp2), ZeRO shards (zero3);
# tp2 and ZeRO-1 groups are in benchmarks/bench_replica_groups.py's parity table (suite time).
PARITY = {"dp2": ("dp4tp1pp1", "dp2tp1pp1", []), "pp2": ("dp2tp1pp2", "dp1tp1pp2", []),
          "zero3": ("dp4tp1pp1", "dp2tp1pp1", ["optimizer.zero_stage=3"])}


def final_weights(run_dir, step: int) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(os.path.join(run_dir, "checkpoints", str(step)))
    return {name: reader.full_tensor(name) for name in reader.full_shapes()}


def assert_same_training(plain: list[dict], ft: list[dict], plain_dir, ft_dir, step: int) -> None:
    torch.testing.assert_close(train_losses(ft), train_losses(plain), rtol=1e-5, atol=0)
    ours, theirs = final_weights(ft_dir, step), final_weights(plain_dir, step)
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=1e-5, msg=name)


def group_summaries(run_dir, count: int = 2) -> list[dict]:
    return [json.load(open(os.path.join(run_dir, f"group_{g}", "summary.json"))) for g in range(count)]


@pytest.mark.parametrize("case", PARITY)
def test_groups_train_as_the_plain_run_of_the_same_batch(case, tmp_path, train_once):
    plain_layout, group_layout, extra = PARITY[case]
    run = BASE + extra + ["tokens.train_steps=4"]
    plain_dir, plain = train_once(run + [f"parallelism={plain_layout}"])
    ft = train(tmp_path, run + [f"parallelism={group_layout}"] + TORCHFT)
    assert_same_training(plain, ft, plain_dir, tmp_path, 4)
    first, second = group_summaries(tmp_path)
    assert first["state_crc32"] == second["state_crc32"]   # every rank's weights, optimizer state and progress
    assert all(record["replica_groups_live"] == 2 for record in ft if "loss" in record)


def test_a_group_killed_in_a_step_rejoins_and_the_run_is_the_failure_free_one(tmp_path, train_once):
    """min_replicas=2: when group 1's rank dies in step 3, group 0 cannot commit alone; group 1 is started again
    (from no checkpoint), copies group 0's state of step 2 over the network, reads its share of step 3 and both
    train on: the same run, to the last weight, as without the failure."""
    run = BASE + ["tokens.train_steps=6"]
    plain_dir, plain = train_once(run + ["parallelism=dp2tp1pp1"])
    ft = train(tmp_path, run + TORCHFT + ["fault_tolerance.min_replicas=2", "fault_injection.kill_group=1",
                                          "fault_injection.kill_at_step=3"])
    assert_same_training(plain, ft, plain_dir, tmp_path, 6)
    first, second = group_summaries(tmp_path)
    assert first["state_crc32"] == second["state_crc32"]
    assert first["fault_tolerance"]["retried_steps"] >= 1 and second["fault_tolerance"]["heals"] == 1
    assert json.load(open(tmp_path / "summary.json"))["groups"][1]["restarts"] == 1


def test_the_live_group_goes_on_alone_and_counts_what_it_trained(tmp_path):
    """min_replicas=1 and no restart: from the step group 0 dies in, group 1 trains its share of each global batch
    alone, and writes the checkpoints (the lowest live group); metrics.jsonl and summary.json count the tokens
    trained, half of the batch's from then on."""
    ft = train(tmp_path, BASE + ["tokens.train_steps=5", "fault_tolerance.max_restarts=0",
                                 "fault_injection.kill_group=0", "fault_injection.kill_at_step=3"] + TORCHFT)
    steps = [record for record in ft if "loss" in record]
    assert [record["replica_groups_live"] for record in steps] == [2, 2, 1, 1, 1]
    per_step = 8 * 32   # tokens.global_batch_size x tokens.sequence_length
    assert [record["consumed_tokens"] for record in steps] == [per_step * n for n in (1, 2)] + [
        per_step * 2 + per_step // 2 * n for n in (1, 2, 3)]
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["status"] == "completed" and summary["consumed_tokens"] == per_step * 7 // 2
    assert summary["groups"][1]["exit_code"] == 0 and summary["groups"][0]["exit_code"] != 0   # -9: SIGKILL
    meta = json.load(open(tmp_path / "checkpoints" / "5" / "meta.json"))
    assert meta["run"]["folder"] == str(tmp_path / "group_1") and meta["consumed_tokens"] == per_step * 7 // 2


def test_a_run_resumes_on_a_plain_layout_and_back(tmp_path, train_once):
    """torchft (2 groups) to step 2, then the whole run started again (torchft, to 4), then a plain dp2 run from
    that checkpoint (to 6); and a plain run's checkpoint continued by replica groups: each the uninterrupted run
    (whose learning-rate schedule does not depend on tokens.train_steps here)."""
    run = BASE + ["optimizer.learning_rate_scheduler.lr_decay_steps=4", "tokens.train_steps=6"]
    plain_dir, plain = train_once(run + ["parallelism=dp2tp1pp1"])
    shared = [f"checkpoint.checkpoints_path={tmp_path / 'checkpoints'}"]
    for folder, steps, extra in [("ft", 2, TORCHFT), ("ft_again", 4, TORCHFT), ("plain", 6, ["parallelism=dp2tp1pp1"])]:
        train(tmp_path / folder, run[:-1] + [f"tokens.train_steps={steps}"] + shared + extra)
    losses = sum((train_losses(read_metrics(tmp_path / folder)) for folder in ("ft", "ft_again", "plain")), [])
    torch.testing.assert_close(losses, train_losses(plain), rtol=1e-5, atol=0)
    back = tmp_path / "back"
    train(back / "first", run[:-1] + ["tokens.train_steps=3", "parallelism=dp2tp1pp1",
                                      f"checkpoint.checkpoints_path={back / 'checkpoints'}"])
    train(back / "then", run + TORCHFT + [f"checkpoint.checkpoints_path={back / 'checkpoints'}"])
    losses = train_losses(read_metrics(back / "first")) + train_losses(read_metrics(back / "then"))
    torch.testing.assert_close(losses, train_losses(plain), rtol=1e-5, atol=0)
    ours, theirs = final_weights(back, 6), final_weights(plain_dir, 6)
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=1e-5, msg=name)


def test_diloco_groups_train_apart_and_agree_at_each_sync(tmp_path):
    """semi_sync=diloco, sync_every=4: the groups all-reduce nothing between syncs and their whole weights (as the
    pseudo-gradient) at each, and end with the same weights; synchronous groups all-reduce the gradients (and two
    scalars of the loss) every step."""
    ft = train(tmp_path, BASE + ["tokens.train_steps=8", "fault_tolerance.semi_sync=diloco",
                                 "fault_tolerance.sync_every=4"] + TORCHFT)
    weights = 4 * sum(record["num_parameters"] for record in [json.load(open(tmp_path / "summary.json"))])
    assert [record["cross_group_bytes"] for record in ft if "loss" in record] == [0, 0, 0, weights] * 2
    first, second = group_summaries(tmp_path)
    assert first["weights_crc32"] == second["weights_crc32"]
    synchronous = train(tmp_path / "sync", BASE + ["tokens.train_steps=2"] + TORCHFT)
    assert [record["cross_group_bytes"] for record in synchronous if "loss" in record] == [weights + 8] * 2
