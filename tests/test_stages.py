"""Data stages: the switch happens at the configured step, each stage's batches depend only on (seed, stage,
global batch), a loader started in the middle of a stage continues with the uninterrupted samples, bad stages are
refused at start naming `data_stages[i]` (tests/test_bad_inputs.py), and the shipped two-stage experiment
trains and reports its stages.
Resuming a training run in the middle of a stage is in tests/test_checkpoint.py (`-k stage`)."""
import json

import numpy as np
import pytest
import torch

from nanoexp.config import ConfigError
from nanoexp.data import Nanoset
from nanoexp.data.preprocess import preprocess
from nanoexp.data.stages import StagedBatches, stage_seed, training_stages
from tests.data_files import random_documents, write_jsonl
from tests.helpers import FAST, compose_config, train
from tests.test_nanoset import write_nanoset

G = 8   # FAST's global batch


def stages_override(first, second, start=3) -> list[str]:
    """data_stages=[...] as one command-line override: Nanoset folders `first` from step 1, `second` from `start`."""
    return [f"data_stages=[{{name: web, start_training_step: 1, data: {{name: nanoset, dataset_folder: [{first}]}}}}, "
            f"{{name: anneal, start_training_step: {start}, data: {{name: nanoset, dataset_folder: [{second}]}}}}]"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("stages")
    return (write_nanoset(root / "web", random_documents(150, seed=1)),
            write_nanoset(root / "anneal", random_documents(80, seed=2)))


def steps(cfg, first_step, count, dp_rank=0, dp=1, **position):
    loader = StagedBatches(cfg, G, dp_rank, dp, first_step, **position)
    try:
        return [torch.cat([mb["input_ids"] for mb in loader.next_step()]) for _ in range(count)], loader
    finally:
        loader.close()


def test_switch_at_the_start_step_reads_each_stage_from_its_own_order(folders):
    cfg = compose_config(FAST + stages_override(*folders, start=3))
    batches, loader = steps(cfg, 1, 4)
    assert loader.stage.name == "anneal" and loader.stage_consumed_samples == {"web": 2 * G, "anneal": 2 * G}
    assert [str(d.folder) for d in loader.val_set.datasets] == [folders[1]]   # evaluation: the stage's held-out split
    assert loader.consumed_samples == 4 * G
    # Reference: each stage's Nanoset read in a GlobalBatchSampler order seeded by (general.seed, stage index).
    for index, (folder, first, last) in enumerate([(folders[0], 0, 2), (folders[1], 2, 4)]):
        dataset = Nanoset(folder, cfg.tokens.sequence_length, "train", cfg.data.validation_fraction)
        order = np.random.default_rng([stage_seed(cfg.general.seed, index), 0]).permutation(len(dataset))
        expected = torch.stack([dataset[int(i)][:-1] for i in order[:(last - first) * G]])
        assert torch.equal(torch.cat(batches[first:last]), expected)


def test_a_data_seed_orders_the_samples_and_general_seed_stays_the_weights(folders):
    """data.seed (nanotron's, per stage) seeds the sample order; null (the default) is general.seed, so runs that
    set none read what they read before the key existed."""
    default = compose_config(FAST)
    assert training_stages(default)[0].seed == default.general.seed == 42
    assert training_stages(compose_config(FAST + ["data.seed=11"]))[0].seed == 11
    with_seed, same_order = (compose_config(FAST + overrides) for overrides in
                             (["general.seed=7", "data.seed=11"], ["general.seed=11"]))
    assert torch.equal(torch.cat(steps(with_seed, 1, 2)[0]), torch.cat(steps(same_order, 1, 2)[0]))
    staged = compose_config(FAST + stages_override(*folders, start=3) + ["general.seed=7",
                                                                          "data_stages.1.data.seed=11"])
    assert [stage.seed for stage in training_stages(staged)] == [stage_seed(7, 0), stage_seed(11, 1)]


def test_stage_batches_do_not_depend_on_the_dp_split(folders):
    cfg = compose_config(FAST + stages_override(*folders, start=2) + ["parallelism.dp=2"])
    whole, _ = steps(compose_config(FAST + stages_override(*folders, start=2)), 1, 3)
    halves = [steps(cfg, 1, 3, dp_rank=r, dp=2)[0] for r in range(2)]
    assert all(torch.equal(whole[s], torch.cat([halves[0][s], halves[1][s]])) for s in range(3))


def test_a_loader_started_in_a_stage_continues_the_uninterrupted_samples(folders):
    cfg = compose_config(FAST + stages_override(*folders, start=3))
    uninterrupted, loader = steps(cfg, 1, 6)
    recorded = {"web": 2 * G, "anneal": 1 * G}   # what a checkpoint after step 3 holds
    resumed, _ = steps(cfg, 4, 3, consumed_samples=3 * G, stage_consumed_samples=recorded)
    assert all(torch.equal(a, b) for a, b in zip(resumed, uninterrupted[3:]))
    # A checkpoint without per-stage positions (a run without stages): the stage starts at (step - start) * G.
    derived, _ = steps(cfg, 4, 3, consumed_samples=3 * G)
    assert all(torch.equal(a, b) for a, b in zip(derived, uninterrupted[3:]))


def test_stage_data_overrides_the_data_group(folders):
    cfg = compose_config(FAST + ["data=nanoset", f"data.dataset_folder=[{folders[0]},{folders[1]}]",
                                 "data.dataset_weights=[0.7,0.3]", "data.validation_fraction=0.1"]
                         + ["data_stages=[{name: a, start_training_step: 1, data: {}}, "
                            f"{{name: b, start_training_step: 5, data: {{dataset_folder: [{folders[1]}]}}}}]"])
    first, second = (stage.cfg.data for stage in training_stages(cfg))
    assert list(first.dataset_folder) == list(folders) and list(first.dataset_weights) == [0.7, 0.3]
    # A stage naming its own folders does not inherit the group's weights; other fields it keeps.
    assert list(second.dataset_folder) == [folders[1]] and second.dataset_weights is None
    assert second.validation_fraction == 0.1 and second.name == "nanoset"


def test_shipped_two_stage_experiment_trains_and_reports_its_stages(tmp_path):
    """conf/experiment/two_stages.yaml with its second stage a Nanoset made by scripts/preprocess_data.py."""
    text = write_jsonl(tmp_path / "anneal.jsonl", random_documents(120, seed=3))
    preprocess([text], str(tmp_path / "anneal"), progress=False)   # scripts/preprocess_data.py's defaults: byte, text
    run = tmp_path / "run"
    records = train(run, ["+experiment=two_stages"] + FAST + [
        "tokens.train_steps=5", "tokens.val_check_interval=2", "data_stages.1.start_training_step=4",
        f"data_stages.1.data.dataset_folder=[{tmp_path / 'anneal'}]"])
    assert [(r["step"], r["stage"]) for r in records if "loss" in r] == [
        (1, "stable"), (2, "stable"), (3, "stable"), (4, "anneal"), (5, "anneal")]
    evaluations = [(r["step"], r["stage"]) for r in records if "eval_loss" in r]
    assert evaluations == [(2, "stable"), (4, "anneal"), (5, "anneal")]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stages"] == [{"name": "stable", "first_step": 1, "last_step": 3},
                                 {"name": "anneal", "first_step": 4, "last_step": 5}]
    log = (run / "logs" / "rank_0.log").read_text()
    assert "data: stage 'stable' of 2, from step 1: builtin" in log
    assert "data stage 'anneal' starts at step 4: nanoset" in log
    meta = json.loads((run / "checkpoints" / "5" / "meta.json").read_text())
    assert meta["stage_consumed_samples"] == {"stable": 3 * G, "anneal": 2 * G} and meta["consumed_samples"] == 5 * G


def test_without_stages_nothing_changes_in_what_a_run_records(tmp_path):
    records = train(tmp_path, FAST + ["tokens.train_steps=2", "tokens.val_check_interval=0"])
    assert all("stage" not in r for r in records)
    assert "stages" not in json.loads((tmp_path / "summary.json").read_text())
    with pytest.raises(ConfigError):   # and the data group is still validated as before
        train(tmp_path / "bad", FAST + ["data=nanoset"])
