"""Sweeps without a cluster: Hydra's multirun, the SLURM task-count rule, sweep reports, make_config.

The local sweep is the README's command with `+experiment=e2e_small` (the tests' FAST model, 6 steps)
and one extra layout that cannot work with that model, so the report must show a failed job.
Reference for the losses: the same training in one process; tolerance from tests/test_parallel.py.
"""
import csv
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from omegaconf import OmegaConf

from nanoexp.config import ConfigError
from nanoexp.validation import validate
from nanoexp.launch.sweep import slurm_tasks_per_node
from tests.helpers import FAST, SLOW, compose_config, read_metrics, train_losses
from tests.test_parallel import assert_same_steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What conf/experiment/e2e_small.yaml adds to FAST: the tests' reference run uses exactly this.
E2E_STEPS = ["tokens.train_steps=6", "tokens.val_check_interval=0", "optimizer.learning_rate_scheduler.lr_warmup_steps=2",
             "general.run=e2e_small"]


def run_script(args, cwd, timeout=300):
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_e2e_small_experiment_is_fast_plus_a_few_steps():
    """The experiment the launcher tests run is the tests' FAST model: their references apply to it."""
    from omegaconf import OmegaConf
    experiment = compose_config(["+experiment=e2e_small"])
    reference = compose_config(FAST + E2E_STEPS)
    assert OmegaConf.to_container(experiment) == OmegaConf.to_container(reference)


def test_task_count_is_derived_or_checked_against_the_layout():
    assert slurm_tasks_per_node([8, 8, 8], nodes=2, tasks_per_node=None) == 4
    assert slurm_tasks_per_node([4, 4], nodes=1, tasks_per_node=4) == 4
    with pytest.raises(ConfigError, match=r"hydra.launcher.tasks_per_node=2 x hydra.launcher.nodes=1 = 2 .* dp\*cp\*tp\*pp = 4"):
        slurm_tasks_per_node([4], nodes=1, tasks_per_node=2)
    with pytest.raises(ConfigError, match=r"hydra.launcher.nodes=3 does not divide the world size dp\*cp\*tp\*pp=8"):
        slurm_tasks_per_node([8], nodes=3, tasks_per_node=None)
    with pytest.raises(ConfigError, match=r"mixes world sizes .*world size 1: jobs \[5\]; world size 2: jobs \[4, 6\]"):
        slurm_tasks_per_node([2, 1, 2], nodes=1, tasks_per_node=None, first_job=4)


@pytest.mark.slow
def test_slurm_sweep_mixing_world_sizes_is_refused_before_submission(tmp_path):
    """No cluster needed: the launcher composes every job and refuses before it builds an executor."""
    result = run_script([os.path.join(ROOT, "train.py"), "-m", "+experiment=e2e_small", "hydra/launcher=slurm",
                         "parallelism=dp2tp1pp1,dp1tp1pp1", f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path)
    assert result.returncode != 0
    assert "mixes world sizes" in result.stderr and "world size 1: jobs [1]" in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "sweep" / ".submitit").exists()


@pytest.fixture(scope="module")
def local_sweep(tmp_path_factory):
    """A 3-job multirun with Hydra's default launcher: two layouts that work, one that cannot."""
    tmp = tmp_path_factory.mktemp("local_sweep")
    sweep = tmp / "sweep"
    result = run_script([os.path.join(ROOT, "train.py"), "-m", "+experiment=e2e_small",
                         "parallelism=dp2tp1pp1,dp1tp2pp1,dp1tp4pp1", f"hydra.sweep.dir={sweep}"], cwd=tmp)
    return tmp, sweep, result


@pytest.mark.slow
def test_local_multirun_runs_every_job_and_matches_one_process(local_sweep, train_once):
    tmp, sweep, result = local_sweep
    # Hydra runs all jobs, then reports the failed one (tp=4 does not divide the 2 KV heads).
    assert result.returncode != 0 and "num_key_value_heads=2 is not divisible by parallelism.tp=4" in result.stderr
    expected = train_once(FAST + E2E_STEPS)[1]
    for job, layout in ((0, "dp2tp1pp1"), (1, "dp1tp2pp1")):
        summary = json.loads((sweep / str(job) / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["layout"] == layout
        records = read_metrics(sweep / str(job))
        assert len(train_losses(records)) == len(train_losses(expected)) == 6
        assert_same_steps(records, expected)   # losses and gradient norms
    failed = json.loads((sweep / "2" / "summary.json").read_text())
    assert failed["status"] == "failed" and "ConfigError" in failed["error"]
    # The sweep ends with its results: the jobs, what differs between them, state, losses, speed.
    report = result.stdout[result.stdout.index(f"sweep {sweep}: 3 jobs, 1 failed"):].splitlines()
    assert report[1].split() == ["job", "overrides", "state", "final_loss", "eval_loss", "tokens_per_sec", "load"]
    rows = [line.split() for line in report[2:5]]
    assert [r[:3] for r in rows] == [["0", "parallelism=dp2tp1pp1", "completed"],
                                     ["1", "parallelism=dp1tp2pp1", "completed"],
                                     ["2", "parallelism=dp1tp4pp1", "failed"]]
    summary = json.loads((sweep / "0" / "summary.json").read_text())
    assert rows[0][3:5] == [f"{summary['final_loss']:.4f}", f"{summary['eval_loss']:.4f}"]   # +experiment: same in all
    load = summary["machine_load"]   # the machine's load before/after each job, in the table
    assert rows[0][6] == f"{load['start']:.1f}/{load['end']:.1f}" and load["processes"] == 2
    assert f"python scripts/summarize_sweep.py {sweep}" in result.stdout


def test_summarize_sweep_lists_the_failed_job_with_its_reason(local_sweep):
    tmp, sweep, _ = local_sweep
    out = tmp / "report"
    result = run_script([os.path.join(ROOT, "scripts", "summarize_sweep.py"), str(sweep), "--out", str(out)], cwd=tmp)
    assert result.returncode == 0, result.stderr
    assert "3 jobs, 1 failed" in result.stdout
    rows = list(csv.DictReader(open(out / "summary.csv")))
    assert [r["job"] for r in rows] == ["0", "1", "2"]   # job order, whichever job has the lower loss on this CPU
    assert [r["state"] for r in rows] == ["completed", "completed", "failed"]
    assert [r["layout"] for r in rows] == ["dp2tp1pp1", "dp1tp2pp1", "dp1tp4pp1"]
    assert "num_key_value_heads=2 is not divisible by parallelism.tp=4" in rows[2]["reason"]
    for job in (0, 1):
        summary = json.loads((sweep / str(job) / "summary.json").read_text())
        assert float(rows[job]["final_loss"]) == summary["final_loss"]
        assert float(rows[job]["tokens_per_sec"]) == summary["tokens_per_sec"]
        job_cfg = OmegaConf.load(sweep / str(job) / ".hydra" / "config.yaml")   # the peak LR the job ran with
        assert float(rows[job]["lr"]) == job_cfg.optimizer.learning_rate_scheduler.learning_rate
    # rank by eval loss, lowest first; equal losses share a place; the failed job has none
    losses = [json.loads((sweep / str(job) / "summary.json").read_text())["eval_loss"] for job in (0, 1)]
    assert [int(rows[job]["rank"]) for job in (0, 1)] == [1 + (losses[1] < losses[0]), 1 + (losses[0] < losses[1])]
    assert rows[2]["rank"] == "" and "rank: by eval_loss, lowest first (rows in job order)" in result.stdout
    for plot in ("loss_curves.png", "tokens_per_sec.png"):
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_make_config_picks_the_least_model_parallel_layout_that_fits(tmp_path):
    """llama3_8b (8.0B parameters) on 16 GPUs of 80 GB: data-parallel only, ZeRO-1 keeps 4 + 4 B a parameter
    whole (60 GiB, plus bf16 weight copies and activations): too big; ZeRO-2 also shards the gradients and fits,
    with no model parallelism. The experiment it writes is coherent: a tokenizer of the model's vocabulary
    (left ??? without --tokenizer, which a run must then set), a schedule of the asked length."""
    command = [os.path.join(ROOT, "scripts", "make_config.py"), "--model", "llama3_8b", "--gpus", "16",
               "--gpu-memory-gb", "80", "--out", str(tmp_path / "llama.yaml"), "--train-steps", "2000"]
    unset = run_script(command, cwd=tmp_path)   # without --tokenizer: the layout all the same, the tokenizer left ???
    assert unset.returncode == 0 and "its tokenizer is left unset (???)" in unset.stdout, unset.stderr
    assert unset.stdout.rstrip().endswith("tokenizer.tokenizer_name_or_path=/path/to/tokenizer")
    assert OmegaConf.is_missing(OmegaConf.load(tmp_path / "llama.yaml").tokenizer, "tokenizer_name_or_path")
    result = run_script(command + ["--tokenizer", "/data/llama3_tokenizer"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "dp8tp2pp1" in result.stdout   # every layout is listed
    assert "chosen: dp16tp1pp1 with ZeRO-2" in result.stdout
    why = result.stdout[result.stdout.index("chosen:"):]
    assert "too big (ZeRO-0" in why and "ZeRO-1" in why and "reduce-scatters them every micro-batch" in why
    assert os.listdir(tmp_path) == ["llama.yaml"]   # nothing else written into the current folder
    text = (tmp_path / "llama.yaml").read_text()
    assert text.startswith("# @package _global_") and "  - override /model: llama3_8b" in text
    experiment = OmegaConf.load(tmp_path / "llama.yaml")
    assert (experiment.parallelism.dp, experiment.parallelism.tp, experiment.parallelism.pp) == (16, 1, 1)
    assert experiment.optimizer.zero_stage == 2 and experiment.tokens.train_steps == 2000
    assert experiment.tokenizer.tokenizer_name_or_path == "/data/llama3_tokenizer"
    # It composes with the defaults into a valid run of 16 processes (the tokenizer folder is not read here).
    conf = tmp_path / "conf"
    shutil.copytree(os.path.join(ROOT, "conf"), conf)
    shutil.copy(tmp_path / "llama.yaml", conf / "experiment" / "llama.yaml")
    from hydra import compose, initialize_config_dir
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+experiment=llama"])
    validate(cfg, world_size=16)
    assert cfg.model.model_config.hidden_size == 4096 and cfg.tokens.train_steps == 2000


def test_make_config_estimate_matches_a_hand_count():
    """tiny on 2 GPUs as dp1tp1pp2 (1F1B, 8 micro-batches of 4 x 128): stage 0 holds 2 layers + the
    embedding and at most 2 micro-batches in flight, stage 1 2 layers + norm + LM head and 1 micro-batch;
    counted here by hand from conf/model/tiny.yaml (h 96, MLP 288, 4 heads / 4 KV heads of 24, vocab 320)."""
    from nanoexp.observe.memory_estimate import estimate as stage_estimate, total
    from nanoexp.model.shape import model_shape
    from nanoexp.plan.memory import estimate
    cfg = compose_config(["parallelism=dp1tp1pp2", "tokens.sequence_length=128", "tokens.micro_batch_size=4"])
    h, kv, mlp, vocab, heads, tokens = 96, 4 * 24, 288, 320, 4, 4 * 128
    layer = 2 * h * h + 2 * h * kv + 3 * h * mlp + 2 * h
    saved = 8 * h + 2 * kv + 4 * mlp + heads + 2            # floats per token a layer keeps for backward
    first = stage_estimate(cfg, model_shape(cfg), 0)
    last = stage_estimate(cfg, model_shape(cfg), 1)
    assert first["parameters"] == 4 * (2 * layer + vocab * h) and first["optimizer"] == 8 * (2 * layer + vocab * h)
    assert last["parameters"] == 4 * (2 * layer + vocab * h + h)
    backward = 2 * mlp   # a layer's backward's MLP gradients beside them (memory_estimate.backward_floats_per_token)
    assert first["activations"] == 4 * tokens * (2 * 2 * saved + backward)         # 2 micro-batches x 2 layers
    assert last["activations"] == 4 * tokens * (2 * saved + backward + 3 * h + 1 + vocab)   # 1 x 2 layers + the head
    busiest = max(first, last, key=total)
    gpu = estimate(cfg)
    assert gpu["parameters"] == busiest["parameters"] and gpu["weight_copies"] == 0   # float32: no bf16 copies
    assert gpu["cuda_context"] > 0


@SLOW
def test_local_submitit_launcher_runs_the_job_from_any_folder(local_sweep, tmp_path):
    """`hydra/launcher=local`: submitit's local executor, started outside the checkout (the job must still
    import nanoexp and the launcher). Same layout as job 0 of the default launcher's sweep: same losses."""
    tmp, reference_sweep, _ = local_sweep
    sweep = tmp_path / "sweep"
    result = run_script([os.path.join(ROOT, "train.py"), "-m", "+experiment=e2e_small", "hydra/launcher=local",
                         "parallelism=dp2tp1pp1", f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert list((sweep / ".submitit").iterdir())   # it went through submitit
    assert json.loads((sweep / "0" / "summary.json").read_text())["status"] == "completed"
    np.testing.assert_allclose(train_losses(read_metrics(sweep / "0")),
                               train_losses(read_metrics(reference_sweep / "0")), atol=1e-6, rtol=0)


def test_sweep_table_shows_only_the_overrides_that_differ_with_one_format_per_column():
    from nanoexp.launch.sweep_report import differing_overrides, table
    rows = [{"job": 0, "overrides": ["+experiment=x", "parallelism=dp2tp1pp1", "lr=0.001"], "final_loss": 2.0,
             "tokens_per_sec": 12345.678, "mfu": 0.1234, "state": "completed"},
            {"job": 1, "overrides": ["+experiment=x", "parallelism=dp1tp2pp1", "lr=0.001", "seed=3"],
             "final_loss": 1.23456789, "tokens_per_sec": 999.0, "mfu": None, "state": "failed"}]
    differing_overrides(rows)
    assert [r["overrides"] for r in rows] == ["parallelism=dp2tp1pp1", "parallelism=dp1tp2pp1 seed=3"]
    lines = table(rows, ["job", "overrides", "final_loss", "tokens_per_sec", "mfu", "state"]).splitlines()
    assert lines[1].split()[2:5] == ["2.0000", "12,346", "12.34%"]
    assert lines[2].split()[3:6] == ["1.2346", "999", "-"]


def test_the_rank_column_ranks_without_reordering_the_jobs():
    from nanoexp.launch.sweep_report import add_rank
    rows = [{"job": j, "eval_loss": v, "eval/t/acc": a}
            for j, (v, a) in enumerate([(2.0, 0.4), (1.9, 0.4), (None, None), (float("nan"), 0.1), (1.9, 0.5)])]
    add_rank(rows, "eval_loss")
    assert [row["job"] for row in rows] == [0, 1, 2, 3, 4] and [row["rank"] for row in rows] == [3, 1, None, None, 1]
    add_rank(rows, "eval/t/acc")   # a task's score: highest first
    assert [row["rank"] for row in rows] == [2, 2, None, 4, 1]


def test_eval_loss_at_each_lr_gives_one_value_per_rate():
    """Two layouts x two rates used to list four values for two rates: jobs at one rate give their mean."""
    from nanoexp.launch.sweep_report import best_lr_table, lr_sweep
    rows = [{"job": j, "lr": lr, "eval_loss": loss, "width": 64, "parametrization": "standard", "optimizer": "adamW"}
            for j, (lr, loss) in enumerate([(1e-3, 2.0), (1e-3, 2.2), (3e-4, 2.5), (3e-4, None)])]
    curves = lr_sweep(rows)
    assert curves == {("standard", 64): [(3e-4, 2.5), (1e-3, pytest.approx(2.1))]}
    last = best_lr_table(curves).splitlines()[-1].split()
    assert last[:3] == ["standard", "64", "0.001"] and last[-2:] == ["2.500", "2.100"]


@pytest.mark.slow
def test_the_loss_curves_legend_hides_no_curve():
    """One legend entry per job, outside the axes (it once covered a curve), inside the saved picture."""
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    from nanoexp.launch.sweep_plots import loss_figure
    rows = [{"job": j, "overrides": f"parallelism=dp{j}tp1pp1 optimizer.lr={j}", "state": "completed"} for j in range(8)]
    curves = {j: [{"step": s, "loss": 3.0 - 0.1 * s} for s in range(1, 21)] + [{"step": 20, "eval_loss": 1.1}]
              for j in range(8)}
    fig = loss_figure(rows, curves)
    fig.canvas.draw()
    ax, = fig.axes
    legend = ax.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == [f"#{j} parallelism=dp{j}tp1pp1 lr={j} (completed)"
                                                          for j in range(8)]   # each key by its last part
    box, axes_box = legend.get_window_extent(), ax.get_window_extent()
    assert box.x0 >= axes_box.x1   # right of the axes: over no curve
    saved = fig.get_tightbbox().transformed(fig.dpi_scale_trans)   # what bbox_inches="tight" saves, in pixels
    assert saved.x0 <= box.x0 and box.x1 <= saved.x1 and saved.y0 <= box.y0 and box.y1 <= saved.y1


def test_jobs_on_a_busy_machine_are_flagged():
    """tokens/s of identical jobs varied 60x in a sweep on a shared machine, unflagged: the report marks jobs whose
    machine load (before the job, or after it beyond its own processes) reached the number of cores."""
    from nanoexp.observe.summary import machine_was_busy
    from nanoexp.launch.sweep_report import busy_note

    def summary(start, end, processes=1):
        return {"machine_load": {"start": start, "end": end, "cpus": 2, "processes": processes}}
    assert not machine_was_busy(summary(0.3, 1.2)) and not machine_was_busy({})
    assert machine_was_busy(summary(2.5, 1.0)) and machine_was_busy(summary(0.2, 4.1, processes=2))
    assert not machine_was_busy(summary(0.2, 3.9, processes=2))   # its own two processes, nothing else
    assert busy_note([{"job": 0, "busy": False}]) is None
    assert "jobs [1, 3]" in busy_note([{"job": j, "busy": j % 2 == 1} for j in range(4)])


def test_plot_runs_draws_each_run_against_the_first(tmp_path):
    """scripts/plot_runs.py: the curves and their difference to the first run, and one line per run."""
    for name, offset in (("a", 0.0), ("b", 0.25)):
        run = tmp_path / name
        run.mkdir()
        lines = [{"step": s, "loss": 3.0 - 0.1 * s + offset} for s in range(1, 6)] + [{"step": 5, "eval_loss": 2.6 + offset}]
        (run / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in lines))
    out = tmp_path / "plot.png"
    result = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plot_runs.py"), str(tmp_path / "a"),
                             str(tmp_path / "b"), "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "b: final loss 2.7500, eval losses 5: 2.8500" in result.stdout and out.stat().st_size > 10_000


def test_place_job_checkpoints_gives_each_sweep_job_its_own_folder():
    from nanoexp.launch.sweep import place_job_checkpoints
    for written, sweep_dir, expected in [("/ck", "/s", "/ck/3"), ("/ck", None, "/ck"), (None, "/s", None),
                                         ("/ck/${hydra:job.num}", "/s", "/ck/${hydra:job.num}")]:
        cfg = OmegaConf.create({"checkpoint": {"checkpoints_path": written}})
        place_job_checkpoints(cfg, "/s/3", sweep_dir)
        assert OmegaConf.to_container(cfg)["checkpoint"]["checkpoints_path"] == expected, written


@pytest.mark.slow
def test_a_relaunched_sweep_leaves_its_finished_jobs_as_they_are(tmp_path):
    """A learning-rate sweep given one checkpoints_path: each job keeps its checkpoints in its own folder below it
    (the second job used to take the first's final checkpoint, train nothing and report null losses); the same
    sweep launched again finds both jobs complete and leaves their summaries, metrics and checkpoints as they are."""
    sweep, ckpts = tmp_path / "sweep", tmp_path / "ckpts"
    command = [os.path.join(ROOT, "train.py"), "-m", *FAST, "tokens.train_steps=2", "tokens.val_check_interval=0",
               "optimizer.learning_rate_scheduler.lr_warmup_steps=1",
               "optimizer.learning_rate_scheduler.learning_rate=1e-3,3e-3", f"checkpoint.checkpoints_path={ckpts}",
               f"hydra.sweep.dir={sweep}"]
    first = run_script(command, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    results = {job: [(sweep / str(job) / name).read_bytes() for name in ("summary.json", "metrics.jsonl")]
               for job in (0, 1)}
    assert all(json.loads(summary)["final_loss"] is not None for summary, _ in results.values())
    assert sorted(os.listdir(ckpts)) == ["0", "1"]
    saved = {job: os.stat(ckpts / job / "2" / "meta.json").st_mtime_ns for job in "01"}
    again = run_script(command, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.count("the run is complete") == 2
    assert results == {job: [(sweep / str(job) / name).read_bytes() for name in ("summary.json", "metrics.jsonl")]
                       for job in (0, 1)}
    assert {job: sorted(os.listdir(ckpts / job)) for job in "01"} == {job: [".nanoexp.lock", "2", "latest.txt"]
                                                                     for job in "01"}
    assert all(os.stat(ckpts / job / "2" / "meta.json").st_mtime_ns == saved[job] for job in "01")
