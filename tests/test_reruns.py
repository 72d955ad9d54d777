"""Starting a run again. A finished run stays finished: its command run again says so and exits 0, leaving
summary.json, metrics and checkpoints as they are; more tokens.train_steps continue it, fewer are refused. A
checkpoint resumes only its own run: another run's, found in a shared checkpoints folder, is refused naming the
training keys that differ; named as checkpoint.resume_checkpoint_path it is a warm start, said so; a checkpoint
written before run ids is judged by its config. A resume on another layout stays possible."""
import json
import os

from nanoexp.checkpoint.identity import training_keys
from tests.helpers import FAST, compose_config, read_metrics, train, train_py

RUN = FAST + ["tokens.val_check_interval=0", "tokens.train_steps=2", "checkpoint.checkpoint_interval=1",
              "optimizer.learning_rate_scheduler.lr_warmup_steps=1"]
LR = "optimizer.learning_rate_scheduler.learning_rate"


def snapshot(folder) -> dict:
    """Every file under `folder` (the run's hidden Hydra files and its lock aside) with its bytes and mtime."""
    files = {}
    for where, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if d != ".hydra"]
        for name in names:
            path = os.path.join(where, name)
            if name not in (".nanoexp.lock", "train.log"):
                files[os.path.relpath(path, folder)] = (open(path, "rb").read(), os.stat(path).st_mtime_ns)
    return files


def test_a_finished_run_stays_finished(tmp_path, capsys):
    """Its command again: exit 0, 'complete', no file touched (summary.json's losses and throughput were nulled
    before); more steps continue it; fewer than it has done are refused in one line naming the step."""
    assert train_py(RUN, tmp_path) == 0
    before = snapshot(tmp_path)
    assert json.loads(before["summary.json"][0])["final_loss"] is not None
    assert train_py(RUN, tmp_path) == 0
    assert snapshot(tmp_path) == before
    said = (tmp_path / "train.log").read_text().splitlines()[-2]   # then the summary line of the finished run
    assert f"the run is complete: its latest checkpoint {tmp_path}/checkpoints/2 is at tokens.train_steps=2" in said
    capsys.readouterr()
    assert train_py(RUN + ["tokens.train_steps=1"], tmp_path) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"nanoexp: checkpoint: {tmp_path}/checkpoints/2, this run's latest checkpoint, "
                                        f"is at step 2, past tokens.train_steps=1: give tokens.train_steps=2 or more "
                                        f"(more continues the run), or roll back by writing an earlier step into "
                                        f"{tmp_path}/checkpoints/latest.txt"]
    assert snapshot(tmp_path) == before
    assert train_py(RUN + ["tokens.train_steps=3"], tmp_path) == 0
    assert [r["step"] for r in read_metrics(tmp_path) if "loss" in r] == [1, 2, 3]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["train_steps"] == 3
    # It covers the whole run (its wall time was the last leg's alone): each leg's steps, wall time and tokens;
    # tokens/s is the last leg's, over the steps it names.
    first = json.loads(before["summary.json"][0])
    tokens_per_step = summary["consumed_tokens"] // 3
    assert [(leg["steps"], leg["tokens"]) for leg in summary["legs"]] == [([1, 2], 2 * tokens_per_step),
                                                                          ([3, 3], tokens_per_step)]
    assert summary["legs"][0] == first["legs"][0] and summary["wall_seconds"] == sum(
        leg["wall_seconds"] for leg in summary["legs"]) > first["wall_seconds"]
    assert summary["tokens_per_sec"] == summary["legs"][1]["tokens_per_sec"] and summary["tokens_per_sec_steps"] == [3, 3]


def test_another_runs_checkpoint_is_refused_naming_the_keys_that_differ(tmp_path, capsys):
    """Two runs one after another on one checkpoints_path (a learning rate each): the second is refused before any
    work, naming the key and the run that saved the checkpoint; named explicitly it is a warm start."""
    shared = f"checkpoint.checkpoints_path={tmp_path}/shared"
    train(tmp_path / "first", RUN + [shared])
    first_id = json.loads((tmp_path / "first" / "summary.json").read_text())["run_id"]
    capsys.readouterr()
    assert train_py(RUN + [shared, f"{LR}=1e-3"], tmp_path / "second") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "belongs to another run" in err[0] and f"run {first_id} in {tmp_path}/first" in err[0]
    assert f"{LR} is 0.004 in the checkpoint, 0.001 here" in err[0]
    assert not (tmp_path / "second" / "metrics.jsonl").exists()
    records = train(tmp_path / "warm", RUN + [f"{LR}=1e-3", "tokens.train_steps=3",
                                              f"checkpoint.resume_checkpoint_path={tmp_path}/shared/2"])
    assert [r["step"] for r in records if "loss" in r] == [3]
    assert (f"warm start: the new run {json.loads((tmp_path / 'warm' / 'summary.json').read_text())['run_id']} "
            f"begins from a checkpoint of run {first_id}, with other training keys: {LR} is 0.004 in the checkpoint, "
            "0.001 here") in rank_0_log(tmp_path / "warm")
    warm_id = json.loads((tmp_path / "warm" / "summary.json").read_text())["run_id"]
    meta = json.loads((tmp_path / "warm" / "checkpoints" / "3" / "meta.json").read_text())
    assert warm_id != first_id and meta["run"] == {"id": warm_id, "folder": str(tmp_path / "warm")}


def test_what_may_change_on_resume_and_what_may_not():
    """Layout, ZeRO stage, steps, batch split, logging and evaluation are not the run; model, optimizer, data,
    tokens and seed are."""
    base = training_keys(_plain(compose_config(RUN)))
    same = compose_config(RUN + ["parallelism=dp2tp2pp2", "optimizer.zero_stage=1", "tokens.train_steps=9",
                                 "tokens.micro_batch_size=1", "logging.iteration_step_info_interval=5",
                                 "tokens.val_check_interval=3", "checkpoint.keep_last_n=1", "data.prefetch=true"])
    assert training_keys(_plain(same)) == base
    for change in ["general.seed=1", f"{LR}=1e-3", "model.model_config.rope_theta=500000", "data.seed=3",
                   "tokens.sequence_length=16", "optimizer.weight_decay=0"]:
        assert training_keys(_plain(compose_config(RUN + [change]))) != base, change


def rank_0_log(run_dir) -> str:
    return (run_dir / "logs" / "rank_0.log").read_text()


def _plain(cfg) -> dict:
    from omegaconf import OmegaConf
    return OmegaConf.to_container(cfg, resolve=True)


def test_a_resume_on_another_layout_and_an_old_checkpoint_without_a_run_id(tmp_path):
    """The same run continued on dp2 with ZeRO-1 keeps its run id; a checkpoint of an earlier nanoexp (no `run` in
    meta.json) is judged by its config alone, said in a warning."""
    train(tmp_path, RUN)
    run_id = json.loads((tmp_path / "summary.json").read_text())["run_id"]
    records = train(tmp_path, RUN + ["tokens.train_steps=3", "parallelism=dp2tp1pp1", "optimizer.zero_stage=1"])
    assert [r["step"] for r in records if "loss" in r][-1] == 3
    assert json.loads((tmp_path / "summary.json").read_text())["run_id"] == run_id
    meta_path = tmp_path / "checkpoints" / "3" / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["run"]
    meta_path.write_text(json.dumps(meta))
    records = train(tmp_path, RUN + ["tokens.train_steps=4"])
    assert [r["step"] for r in records if "loss" in r][-1] == 4
    assert "records no run id (saved by an earlier nanoexp): it was judged by its training keys alone" in \
        rank_0_log(tmp_path)
    meta_path.write_text(json.dumps({**meta, "config": {**meta["config"], "general": {"seed": 7}}}))
    (tmp_path / "checkpoints" / "latest.txt").write_text("3\n")
    assert train_py(RUN + ["tokens.train_steps=4"], tmp_path) == 2   # judged by its config: another seed


def test_only_a_resumed_leg_of_the_same_run_adds_to_the_legs_before_it(tmp_path):
    from nanoexp.observe.summary import whole_run, write_summary
    write_summary(str(tmp_path), {"run_id": "a", "legs": [{"steps": [1, 5], "wall_seconds": 10.0}]})
    leg = {"steps": [6, 9], "wall_seconds": 4.0}
    assert whole_run(str(tmp_path), {"run_id": "a"}, leg, resumed=True) == {
        "run_id": "a", "legs": [{"steps": [1, 5], "wall_seconds": 10.0}, leg], "wall_seconds": 14.0}
    for run_id, resumed in (("b", True), ("a", False)):   # another run's folder; a run that started afresh
        assert whole_run(str(tmp_path), {"run_id": run_id}, leg, resumed)["wall_seconds"] == 4.0
