"""Replica groups on SLURM (`train.py -m hydra/launcher=slurm fault_tolerance=torchft`): the sweep's job of the run
is one task that starts the lighthouse and submits the 2 groups as a job array (nanoexp/launch/slurm_groups.py).
The `service` tests run on the one-node cluster of scripts/local_slurm_start.sh, skipped without it (an error under
CI=true); the others check, without a cluster, what the groups' jobs are submitted with and what is refused.

Group 1's only rank is SIGKILLed in step 3 (its job fails) with min_replicas=2: the run's job submits group 1
again, it copies group 0's state, and the run is the failure-free plain dp2 run of the same global batch, to the
tolerances of tests/test_replica_groups.py (losses rtol 1e-5, weights atol 1e-5: the gradients of two dp1 groups
are averaged across the groups where the plain run averages over dp2, the same two numbers; measured equal)."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from hydra_plugins.nanoexp_launchers import groups_jobs
from nanoexp.config import ConfigError, compose
from nanoexp.launch.slurm_groups import group_executor, groups_folder
from tests.helpers import read_metrics
from tests.slurm_cluster import ROOT, THIS_MACHINE, finish, require_cluster, sacct_states, slurm_job_ids, wait_until
from tests.test_replica_groups import BASE, assert_same_training, group_summaries

NEEDS_TORCHFT = pytest.mark.skipif(importlib.util.find_spec("torchft") is None and os.environ.get("CI") != "true",
                                   reason="pip install -e '.[ft]'")
CLUSTER = THIS_MACHINE
# A restarted group's job waits for sacct (2 s looks), the scheduler and its imports: give the waiting group time.
TORCHFT = ["fault_tolerance=torchft", "fault_tolerance.min_replicas=2", "fault_tolerance.quorum_timeout_s=120"]


@pytest.fixture(scope="module")
def slurm():
    require_cluster(CLUSTER)


def start_run(sweep_dir, *overrides) -> subprocess.Popen:
    command = CLUSTER.command(sys.executable, os.path.join(ROOT, "train.py"), "-m", "hydra/launcher=slurm",
                              f"hydra.sweep.dir={sweep_dir}", *BASE, *TORCHFT, *overrides)
    return subprocess.Popen(command, cwd=os.path.dirname(sweep_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=CLUSTER.environ())


def group_jobs(sweep_dir) -> list[str]:
    """The SLURM ids of the run's group jobs, in submission order (submitit's folders beside the sweep's)."""
    folder = os.path.join(sweep_dir, ".submitit", "groups_0")
    names = [name for name in (os.listdir(folder) if os.path.isdir(folder) else ())
             if os.path.exists(os.path.join(folder, name, f"{name}_submitted.pkl"))]   # a job's folder (only tested for)
    return sorted(names, key=lambda name: [int(part) for part in name.split("_")])


LAUNCHER = {"_target_": "hydra_plugins.nanoexp_launchers.NanoexpSlurmLauncher", "partition": "gpu", "nodes": 2,
            "tasks_per_node": None, "gpus_per_node": 8, "cpus_per_task": None, "mem_gb": None, "timeout_min": 60,
            "signal_delay_s": 120, "max_num_timeout": 3, "additional_parameters": {"account": "ml"},
            "array_parallelism": 256, "setup": ["module load cuda"], "name": "train",
            "submitit_folder": "/sweep/.submitit/%j", "stderr_to_stdout": False}


def test_group_jobs_have_the_launchers_resources_and_the_groups_tasks():
    """A group of 16 ranks over the launcher's 2 nodes: 8 tasks a node, with every other sbatch setting as
    hydra.launcher gave it; submitit's files beside the sweep's, out of the pattern the sweep report reads."""
    script = group_executor(LAUNCHER, 16, groups_folder(LAUNCHER, "/sweep/3", "/sweep"))._executor.\
        _make_submission_file_text("python -m submitit.core._submit", "uid")
    for line in ("--nodes=2", "--ntasks-per-node=8", "--gpus-per-node=8", "--partition=gpu", "--time=60",
                 "--signal=USR2@120", "--account=ml", "--job-name=train",
                 "--output=/sweep/.submitit/groups_3/%j/%j_0_log.out"):
        assert f"#SBATCH {line}\n" in script, line
    assert "\nmodule load cuda\n" in script
    with pytest.raises(ConfigError, match="hydra.launcher.nodes=2 does not divide the world size"):
        group_executor(LAUNCHER, 3, "/sweep/.submitit/groups_0/%j")


def test_a_sweep_mixing_replica_group_runs_and_plain_runs_is_refused():
    configs = [compose(BASE + ["fault_tolerance=torchft"]), compose(BASE)]
    assert groups_jobs(configs[:1], 0) and not groups_jobs(configs[1:], 0)
    with pytest.raises(ConfigError, match=r"fault_tolerance: .* jobs \[4\] are replica-group runs"):
        groups_jobs(configs, 4)


@pytest.mark.service
@NEEDS_TORCHFT
def test_a_killed_group_job_is_submitted_again_heals_and_the_run_is_the_failure_free_one(slurm, tmp_path, train_once):
    sweep = tmp_path / "sweep"
    process = start_run(sweep, "tokens.train_steps=6", "fault_injection.kill_group=1", "fault_injection.kill_at_step=3")
    plain_dir, plain = train_once(BASE + ["tokens.train_steps=6", "parallelism=dp2tp1pp1"])   # meanwhile
    code, err = finish(process, timeout=300)
    assert code == 0, err[-3000:]
    run = sweep / "0"
    assert_same_training(plain, read_metrics(run), plain_dir, run, 6)
    first, second = group_summaries(run)
    assert first["state_crc32"] == second["state_crc32"] and second["fault_tolerance"]["heals"] == 1
    assert [g["restarts"] for g in json.load(open(run / "summary.json"))["groups"]] == [0, 1]
    # The run's own job was one task; the groups were an array of two, and group 1's second job.
    array, again = group_jobs(sweep)[:2], group_jobs(sweep)[2:]
    assert [job.split("_")[1] for job in array] == ["0", "1"] and len(again) == 1, group_jobs(sweep)
    wait_until(lambda: sacct_states(CLUSTER, array[1]) == ["FAILED"], 60, f"sacct to show {array[1]} FAILED")
    for job in (array[0], again[0], slurm_job_ids(sweep)[0]):
        wait_until(lambda: sacct_states(CLUSTER, job) == ["COMPLETED"], 60, f"sacct to show {job} COMPLETED")


@pytest.mark.service
@NEEDS_TORCHFT
def test_cancelling_the_run_cancels_its_group_jobs(slurm, tmp_path):
    """scancel of the run's job (SIGTERM to it): it cancels the group jobs before it goes, nothing is left queued
    or running."""
    sweep = tmp_path / "sweep"
    process = start_run(sweep, "tokens.train_steps=100000", "fault_injection.slow_step_s=0.3")
    wait_until(lambda: (sweep / "0" / "group_1" / "metrics.jsonl").exists(), 180, "group 1 to train")
    run_job = slurm_job_ids(sweep)[0]
    CLUSTER.run("scancel", run_job, check=True)
    code, err = finish(process, timeout=120)
    assert code != 0
    assert group_jobs(sweep)
    for job in group_jobs(sweep):
        wait_until(lambda: sacct_states(CLUSTER, job)[:1] == ["CANCELLED"], 60, f"sacct to show {job} CANCELLED")
