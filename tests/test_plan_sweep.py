"""`python train.py -m +plan=topK`: the planner's top K layouts as sweep jobs (nanoexp/plan/sweep.py,
hydra_plugins/nanoexp_sweeper.py) and the report's predicted-beside-measured table (sweep_report.plan_table).

The expansion is checked against search.rank called directly on each job's config (the same ranking the sweep
must run), on the H100 entry so that no calibration runs; the end-to-end sweep trains the tests' FAST model.
"""
import json
import os
import subprocess
import sys

import pytest

from nanoexp.config import ConfigError, normalize
from nanoexp.launch.sweep_report import plan_table, read_plan
from nanoexp.parallel.layout import Layout
from nanoexp.plan.hardware import GPUS
from nanoexp.plan.search import rank
from nanoexp.plan.sweep import expand, gpu_of, machine, top_of, write_plan
from nanoexp.validation import validate
from tests.helpers import FAST, SLOW, compose_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = [o for o in FAST if not o.startswith("tokens.micro_batch_size")]   # the plan chooses the micro-batch
LR = "optimizer.learning_rate_scheduler.learning_rate"


def composed(overrides):
    return compose_config(MODEL + list(overrides))


@pytest.mark.parametrize("value, k", [("top4", 4), ("top1", 1), ("top12", 12)])
def test_top_of_reads_k(value, k):
    assert top_of(value) == k


@pytest.mark.parametrize("value", ["top0", "foo", "top", "top-2", "4"])
def test_top_of_refuses_anything_else_naming_plan(value):
    with pytest.raises(ConfigError, match=rf"^plan={value}: must be topK"):
        top_of(value)


@pytest.mark.slow
def test_expand_crosses_the_top_layouts_with_the_other_axes():
    """2 learning rates x top 3 on 4 H100s: 6 jobs, rank 1 of both rates first, each job the rate's overrides then
    the layout search.rank puts at that place; every job composes to a valid config of 4 processes."""
    axes = [[f"{LR}=0.001"], [f"{LR}=0.0003"]]
    jobs, records = expand(axes, 3, composed, 4, 4, GPUS["h100"])
    cfg = composed(axes[0])
    normalize(cfg)
    expected = rank(cfg, 4, 4, GPUS["h100"], 3).predictions
    assert len(jobs) == len(records) == 6
    for n, (job, record) in enumerate(zip(jobs, records)):
        place, axis = divmod(n, 2)
        assert job[:1] == axes[axis] and job[1:-1] == expected[place].overrides()
        assert job[-1] == "tokens.batch_accumulation_per_replica=null"
        assert record["rank"] == place + 1 and record["layout"] == expected[place].name
        assert record["step_time_s"] == expected[place].step_time_s
        assert record["tokens_per_s"] == pytest.approx(4 * expected[place].tokens_per_s_per_gpu, rel=1e-12)
        run = composed(job)
        validate(run, world_size=4)
        assert Layout.from_config(run).world_size == 4
        assert run.optimizer.zero_stage == expected[place].zero_stage


@pytest.mark.parametrize("axis", ["tokens.micro_batch_size=2", "parallelism=dp2tp1pp1", "optimizer.zero_stage=1",
                                  "+parallelism.tp=2"])
def test_expand_refuses_keys_the_plan_sets(axis):
    with pytest.raises(ConfigError, match=r"^plan: .*remove " + axis.partition("=")[0].replace("+", r"\+")):
        expand([[axis]], 2, composed, 2, 2, GPUS["h100"])


def test_expand_refuses_more_layouts_than_fit():
    with pytest.raises(ConfigError, match=r"^plan=top100000: only \d+ layouts of 2 processes"):
        expand([[]], 100000, composed, 2, 2, GPUS["h100"])


def test_machine_reads_the_sweeper_settings():
    assert machine(8, "h200", None) == (8, 8, GPUS["h200"])
    assert machine(16, "a100", 8) == (16, 8, GPUS["a100"])
    assert gpu_of("NVIDIA H100 80GB HBM3") == "h100"


@pytest.mark.parametrize("gpus, gpu, per_node, key", [(0, "h100", None, "hydra.sweeper.gpus=0"),
                                                      (8, "h100", 3, "hydra.sweeper.gpus_per_node=3"),
                                                      (2, "tpu", None, "hydra.sweeper.gpu=tpu")])
def test_machine_refuses_bad_settings_naming_the_key(gpus, gpu, per_node, key):
    with pytest.raises(ConfigError, match=f"^{key}"):
        machine(gpus, gpu, per_node)


def test_an_unknown_gpu_names_the_key():
    with pytest.raises(ConfigError, match=r"^hydra.sweeper.gpu: this GPU \(Tesla T4\)"):
        gpu_of("Tesla T4")


def test_plan_table_puts_predicted_beside_measured(tmp_path):
    """Job 0 measured at half the predicted tokens/s: its step took twice as long (ratio 2.00); job 1 has no
    measurement (failed): dashes; job 2 has no prediction (not a planned job): no line."""
    record = {"layout": "dp2tp1pp1", "step_time_s": 0.1, "tokens_per_s": 40960.0, "mfu": 0.1, "memory_gib": 0.1,
              "zero_stage": 1, "micro_batch": 4, "recompute": "none", "tokens_per_step": 4096, "rank": 1}
    write_plan(str(tmp_path), [record, record | {"rank": 2}], 2, 2, GPUS["h100"])
    assert read_plan(str(tmp_path))["jobs"]["1"]["rank"] == 2
    rows = [{"job": 0, "tokens_per_sec": 20480.0}, {"job": 1, "tokens_per_sec": None}, {"job": 2}]
    lines = plan_table(str(tmp_path), rows).splitlines()
    assert lines[0].startswith("planned for 2 x H100 SXM")
    assert len(lines) == 4
    assert lines[2].split() == ["0", "1", "dp2tp1pp1", "1", "4", "none", "0.1000", "0.2000", "2.00", "40,960", "20,480"]
    assert lines[3].split()[-4:] == ["-", "-", "40,960", "-"]
    assert plan_table(str(tmp_path / "none"), rows) is None


def train_py(args, cwd):
    return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=cwd, capture_output=True, check=False,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("args, key", [pytest.param(["-m", "+plan=top0"], "plan=top0"),
                                       pytest.param(["-m", "+plan=foo"], "plan=foo", marks=SLOW),
                                       pytest.param(["+plan=top4"], "plan: +plan=topK runs", marks=SLOW)])
def test_bad_plans_stop_before_any_job_with_one_line(tmp_path, args, key):
    result = train_py([*args, f"hydra.sweep.dir={tmp_path}/sweep", f"hydra.run.dir={tmp_path}/run"], tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert key in result.stderr and "nanoexp: invalid config: " in result.stderr
    assert not os.path.exists(tmp_path / "sweep" / "0") and not os.path.exists(tmp_path / "run")


@SLOW
def test_top2_sweep_runs_and_reports_predicted_beside_measured(tmp_path):
    """Two jobs of 2 gloo processes, 3 steps: each job runs the layout plan.json predicted for it, and the
    report printed at the end of the sweep has a predicted-vs-measured line for each."""
    sweep = tmp_path / "sweep"
    result = train_py(["-m", "+plan=top2", "hydra.sweeper.gpus=2", "hydra.sweeper.gpu=cpu", *MODEL,
                       "tokens.train_steps=3", "tokens.val_check_interval=0", f"hydra.sweep.dir={sweep}"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    plan = read_plan(str(sweep))
    assert plan["gpus"] == 2 and sorted(plan["jobs"]) == ["0", "1"]
    table = result.stdout[result.stdout.index("planned for 2 x this CPU"):].splitlines()
    for job, record in plan["jobs"].items():
        with open(sweep / job / "summary.json") as f:
            summary = json.load(f)
        assert summary["status"] == "completed"
        run = compose_config(MODEL + [o for o in record_overrides(sweep / job)])
        assert Layout.from_config(run).name == record["layout"]
        assert run.optimizer.zero_stage == record["zero_stage"]
        line = table[2 + int(job)].split()
        assert line[:3] == [job, str(record["rank"]), record["layout"]]
        measured = record["tokens_per_step"] / summary["tokens_per_sec"]
        assert float(line[7]) == pytest.approx(measured, abs=5e-5)   # printed to 4 decimals
        assert float(line[8]) == pytest.approx(measured / record["step_time_s"], abs=5e-3)   # printed to 2


def record_overrides(job_dir):
    import yaml
    with open(job_dir / ".hydra" / "overrides.yaml") as f:
        return yaml.safe_load(f)
