"""From a composed config to a finished run: check (normalise, then validate), launch, run the trainer on
each rank, and report how the run ended."""
from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from nanoexp.checkpoint.manager import check_resume, checkpoints_root
from nanoexp.checkpoint.save import CheckpointError
from nanoexp.checks import check_config
from nanoexp.config import ConfigError
from nanoexp.observe.console import resume_command, summary_line
from nanoexp.evaluation.downstream import environment
from nanoexp.failures import is_known
from nanoexp.launch.workers import (WorkerFailed, die_with_parent, export_slurm_rendezvous, init_distributed, lost_peer,
                                    setup_device, spawn_local)
from nanoexp.numerics.precision import denormals_flushed, set_tf32
from nanoexp.instruments.flight_recorder import recorder_env
from nanoexp.instruments.memory import return_freed_memory
from nanoexp.parallel.context import launcher_env
from nanoexp.parallel.layout import Layout
from nanoexp.parallel.replicas import check_lighthouse
from nanoexp.observe.peak import (Peak, job_peak, mfu_peak, node_peak, peak_dtype, slow_dtype_warning,
                                  sum_of_node_peaks)
from nanoexp.launch.replica_groups import checkpoints_folder, group_folder, launch_replica_groups
from nanoexp.launch.slurm_groups import SlurmGroups
from nanoexp.launch.run_lock import RunFolderBusy, own_folders
from nanoexp.launch.signals import (StopBeforeTraining, handle_stop_signals, received_signal_name, stop_requested,
                                    training_started)
from nanoexp.launch.sweep import place_job_checkpoints
from nanoexp.observe.summary import read_summary, record_failure, record_machine_load, stopped_by_signal

log = logging.getLogger("nanoexp")


@dataclass
class HydraJob:
    """What the Hydra job tells the run (train.py reads it from HydraConfig): its command-line
    overrides, Hydra's `override_dirname` of them, and the sweep folder in a multirun."""
    overrides: list[str] = field(default_factory=list)
    override_dirname: str = ""
    sweep_dir: str | None = None
    created_folder: str | None = None   # the outermost folder Hydra made for this run (None: it existed)
    slurm_launcher: dict | None = None   # hydra.launcher, in a job of hydra/launcher=slurm (replica groups' jobs)

    @property
    def multirun(self) -> bool:
        return self.sweep_dir is not None

# Keep the shared console and train.log readable: rank 0 talks, every rank has its own file, saying its host.
LOG_FORMAT = "[%(asctime)s][rank {rank} on {host}][%(levelname)s] %(message)s"


def setup_rank_logging(run_dir: str, rank: int, talks: bool = True) -> None:
    """This rank's log file; the console and train.log stay with rank 0 (`talks`: of replica group 0)."""
    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
    root = logging.getLogger()
    for handler in list(root.handlers):
        # Forked workers inherit rank 0's console and train.log handlers; a process that runs
        # several trainings in turn must not keep writing into the earlier runs' files.
        if rank != 0 or not talks or handler.get_name() == "nanoexp_rank":
            root.removeHandler(handler)
            if handler.get_name() == "nanoexp_rank":
                handler.close()
    handler = logging.FileHandler(os.path.join(run_dir, "logs", f"rank_{rank}.log"))
    handler.set_name("nanoexp_rank")
    handler.setFormatter(logging.Formatter(LOG_FORMAT.format(rank=rank, host=socket.gethostname())))
    root.addHandler(handler)
    root.setLevel(logging.INFO)


def worker(rank: int, world_size: int, device, cfg, run_dir: str, cpu_peak: Peak | None = None) -> dict:
    """What every rank runs: its context, its model shard, the loop."""
    setup_rank_logging(run_dir, rank, talks=cfg.fault_tolerance.group in (None, 0))
    if device.type == "cpu" and cfg.logging.exact_cpu_memory:
        return_freed_memory()
    with denormals_flushed(cfg, device):   # model.flush_denormals; before the groups, whose threads copy the mode
        return train_rank(rank, world_size, device, cfg, run_dir, cpu_peak)


def train_rank(rank: int, world_size: int, device, cfg, run_dir: str, cpu_peak: Peak | None) -> dict:
    """This rank's context and peak, then its trainer under the stall watchdog (and the faults asked for)."""
    from nanoexp import health
    from nanoexp.launch.fault_injection import FaultInjection
    from nanoexp.launch.watchdog import StallWatchdog
    from nanoexp.parallel.context import ParallelContext
    from nanoexp.runtime.replica_trainer import ReplicaTrainer
    from nanoexp.runtime.seams import StopSignals
    from nanoexp.runtime.trainer import Trainer

    ctx = ParallelContext(Layout.from_config(cfg), device, cfg.parallelism.collective_timeout_s)
    nodes = world_size // int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    set_tf32(cfg, device)   # before any matmul: model.allow_tf32 (on by default on CUDA)
    if device.type == "cuda" and cfg.debug.cuda_sync != "off":
        torch.cuda.set_sync_debug_mode(cfg.debug.cuda_sync)   # every host wait for the GPU warns (or raises)
    peak = job_peak(device, peak_dtype(cfg, device), cfg.logging.peak_tflops, world_size, nodes, cpu_peak)
    with StallWatchdog(cfg, ctx, run_dir) as watchdog:
        signals = StopSignals(training_started, stop_requested, received_signal_name)   # launch/signals.py's
        loop = Trainer if cfg.fault_tolerance.method == "none" else ReplicaTrainer
        trainer = loop(cfg, ctx, run_dir, peak, signals)
        # Each wraps the trainer's phases only when on: by default the loop runs with nothing of them.
        watchdog.watch(trainer)   # heartbeat marks
        FaultInjection(cfg.fault_injection, rank).install(trainer)   # the robustness tests' faults
        health.install(cfg, trainer)   # stragglers, loss spikes, replay checks (nanoexp/health/)
        return trainer.train()


def fill_wandb_identity(cfg, job: HydraJob) -> None:
    """W&B run name, group and tags left null: the job's overrides (or general.run), the sweep
    folder in a multirun, the layout."""
    w = cfg.logging.wandb
    w.name = w.name or job.override_dirname or cfg.general.run
    w.group = w.group or job.sweep_dir
    w.tags = list(w.tags) if w.tags is not None else [Layout.from_config(cfg).name]


def node_cpu_peak(cfg) -> Peak | None:
    """This node's matmul peak (nanoexp/observe/peak.py), measured with all its cores before any worker starts, when MFU
    on CPU needs it (no GPU, no logging.peak_tflops); a warning when model.dtype is far slower than float32, and no
    peak (its reason instead) for FP8 products that run in software."""
    if torch.cuda.is_available() or cfg.logging.peak_tflops:
        return None
    threads, dtype = os.cpu_count() or 1, peak_dtype(cfg)
    peak = node_peak(dtype, threads)
    if dtype == "float32":
        return peak
    float32 = node_peak("float32", threads)   # what another dtype's speed is told against
    warning = slow_dtype_warning(dtype, peak, float32)
    if warning:
        log.warning("%s", warning)
    return mfu_peak(dtype, peak, float32)


def run(cfg, run_dir: str, job: HydraJob | None = None) -> None:
    """Check the config, own the run's folders, then train in this process, in the launcher's world, or in
    local workers."""
    env, job = launcher_env(), job or HydraJob()
    owner = env is None or env["rank"] == 0   # the other ranks of a launcher's world write into rank 0's folder
    place_job_checkpoints(cfg, run_dir, job.sweep_dir)   # a sweep's jobs never share a checkpoints folder
    check_config(cfg, world_size=env["world_size"] if env else None, run_dir=run_dir if owner else None)
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))   # plain, picklable, resolved
    cfg, run_dir, folders = place_replica_group(cfg, run_dir, env)
    world = Layout.from_config(cfg).world_size
    fill_wandb_identity(cfg, job)
    os.makedirs(run_dir, exist_ok=True)
    with own_folders(folders if owner else []):
        complete = None   # the line saying the run is complete already (rank 0 knows)
        if owner:
            log.info("run folder: %s", os.path.abspath(run_dir))
            complete = check_resume_point(cfg, run_dir)   # once the folder is ours: nobody moves latest.txt now
        if complete and env is None:   # nothing to train: summary.json, metrics and checkpoints stay as they are
            log.info("%s", complete)
            return
        load = os.getloadavg()[0]
        with handle_stop_signals():   # before step 1 the run ends at once; then every rank checkpoints after its step
            launch_and_train(cfg, run_dir, env, world, complete, job)
    if complete:
        return
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if env else world
    record_machine_load(run_dir, load, os.getloadavg()[0], local_processes)


def place_replica_group(cfg, run_dir: str, env: dict | None) -> tuple:
    """(config, run folder, folders the run owns). One replica group of several (fault_tolerance.group set: on
    another host, a SLURM job) trains in <run>/group_<g> and owns only that: the checkpoints are shared."""
    ft = cfg.fault_tolerance
    if ft.method == "none" or ft.group is None:
        if ft.method != "none" and env is not None:
            raise ConfigError("fault_tolerance.group=null under torchrun or SLURM: each of their worlds is one "
                              "replica group: set fault_tolerance.group and fault_tolerance.lighthouse")
        return cfg, run_dir, [run_dir, checkpoints_root(cfg, run_dir)]
    check_lighthouse(ft.lighthouse, ft.quorum_timeout_s)
    cfg.checkpoint.checkpoints_path = checkpoints_folder(cfg, run_dir)
    return cfg, group_folder(run_dir, ft.group), [group_folder(run_dir, ft.group)]


def train_group(cfg, run_dir: str) -> None:
    """One replica group, in <run>/group_<g>, started by launch_replica_groups: a child process on this machine, or
    each task of the group's SLURM job (a rank of its world). Whoever started the groups owns the run's folders."""
    os.makedirs(run_dir, exist_ok=True)
    world = Layout.from_config(cfg).world_size
    with debug_environment(cfg):
        start_workers(cfg, run_dir, launcher_env(), world, processes_here=world * cfg.fault_tolerance.replica_groups)


def check_resume_point(cfg, run_dir: str) -> str | None:
    """The checkpoint this run resumes from is whole, this run's, fits the model and leaves steps to train (a
    ConfigError naming the file, the keys, the first parameter or the step); the line saying the run is complete
    when its own checkpoint is at tokens.train_steps already."""
    try:
        return check_resume(cfg, run_dir)
    except CheckpointError as error:
        raise ConfigError(f"checkpoint: {error}") from None


def debug_environment(cfg):
    """What torch reads when process groups are made, for this run only (a context): the flight recorder's size
    (debug.flight_recorder_entries), with debug.collectives=check TORCH_DISTRIBUTED_DEBUG=DETAIL, and with
    health.replay_every on CUDA cuBLAS's deterministic workspace."""
    wanted = recorder_env(cfg.debug.flight_recorder_entries)
    if cfg.debug.collectives == "check":
        wanted["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    if cfg.health.replay_every and torch.cuda.is_available():   # nanoexp/health/replay.py
        wanted["CUBLAS_WORKSPACE_CONFIG"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    return environment(**wanted)


def launch_and_train(cfg, run_dir: str, env: dict | None, world: int, complete: str | None = None,
                     job: HydraJob | None = None) -> None:
    with debug_environment(cfg):
        start_workers(cfg, run_dir, env, world, complete, job=job)


def start_workers(cfg, run_dir: str, env: dict | None, world: int, complete: str | None = None,
                  processes_here: int | None = None, job: HydraJob | None = None) -> None:
    """Train in this process, in the launcher's world, in local workers, or in replica groups on this machine
    (under hydra/launcher=slurm: as SLURM jobs); `processes_here`: the processes that share this machine's cores
    (default: this run's)."""
    if env is not None:   # torchrun or SLURM started us: join their world
        join_launcher_world(cfg, run_dir, env, complete)
    elif cfg.fault_tolerance.method != "none" and cfg.fault_tolerance.group is None:
        if job is not None and job.slurm_launcher is not None:
            launch_replica_groups(cfg, run_dir, train_group, SlurmGroups.on(job.slurm_launcher, run_dir,
                                                                            job.sweep_dir))
        else:
            launch_replica_groups(cfg, run_dir, train_group)
    elif world == 1:
        worker(0, 1, setup_device(0, processes_here or 1), cfg, run_dir, sum_of_node_peaks([node_cpu_peak(cfg)]))
    else:
        spawn_local(world, worker, (cfg, run_dir, sum_of_node_peaks([node_cpu_peak(cfg)])),
                    timeout_s=cfg.parallelism.collective_timeout_s, method=cfg.parallelism.start_method,
                    processes_here=processes_here)


def join_launcher_world(cfg, run_dir: str, env: dict, complete: str | None = None) -> None:
    """This process is one rank of a world torchrun or SLURM started, on one node or several. `complete`: rank 0's
    line saying the run is complete already; then every rank leaves without training."""
    die_with_parent(os.getppid())   # the agent (torchrun) or task launcher (SLURM): a worker never outlives it
    export_slurm_rendezvous()   # MASTER_ADDR/PORT from the SLURM node list (torchrun sets its own)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", env["world_size"]))
    if env["rank"] == 0:
        for warning in launcher_warnings(Layout.from_config(cfg), local_world):
            log.warning("%s", warning)
    # Each node's first rank measures its node's peak with every core while its peers wait in init.
    peak = node_cpu_peak(cfg) if env["local_rank"] == 0 else None
    device = setup_device(env["local_rank"], local_world)
    init_distributed(env["rank"], env["world_size"], device, cfg.parallelism.collective_timeout_s)
    shared, node_peaks = [run_dir, complete], [None] * env["world_size"]
    dist.broadcast_object_list(shared, src=0)   # every rank writes into rank 0's run folder
    dist.all_gather_object(node_peaks, peak)
    try:
        if shared[1]:
            if env["rank"] == 0:
                log.info("%s", shared[1])
            return
        worker(env["rank"], env["world_size"], device, cfg, shared[0], sum_of_node_peaks(node_peaks))
    except RuntimeError as error:   # one line for a lost peer: its host, and that the checkpoints are intact
        lost = lost_peer(error, cfg.parallelism.collective_timeout_s)
        if lost is None:
            raise
        raise WorkerFailed(f"rank {env['rank']} on {socket.gethostname()}: {lost}; the run stopped, its "
                           "checkpoints are intact (resume with checkpoint.resume=auto)") from error
    finally:
        dist.destroy_process_group()


def launcher_warnings(layout: Layout, ranks_per_node: int) -> list[str]:
    """What rank 0 warns about a launcher's world before it starts: tp or cp groups that cross nodes."""
    return [f"parallelism.{dim}={getattr(layout, dim)} spans nodes of {ranks_per_node} ranks: its collectives in "
            "every layer cross the network; keep tp·cp within a node (dividing the ranks per node), see "
            "docs/multi-node.md" for dim in layout.dims_crossing_nodes(ranks_per_node)]


def remove_run_folder(folder: str) -> None:
    """Remove a folder made for a refused run, detaching the log files (train.log) written into it."""
    loggers = [logging.getLogger()] + [logging.getLogger(name) for name in logging.root.manager.loggerDict]
    for logger in loggers:
        for handler in list(logger.handlers):
            if isinstance(handler, logging.FileHandler) and handler.baseFilename.startswith(folder + os.sep):
                logger.removeHandler(handler)
                handler.close()
    shutil.rmtree(folder, ignore_errors=True)


def report_end(run_dir: str, job: HydraJob) -> None:
    """The launching process's last lines: the summary, and how to resume a stopped run."""
    env = launcher_env()
    summary = read_summary(run_dir) if env is None or env["rank"] == 0 else None
    if summary is None:
        return
    log.info("%s", summary_line(summary, os.path.abspath(os.path.join(run_dir, "summary.json"))))
    if summary.get("status") == "stopped":
        log.info("stopped by a signal after step %s, checkpoint written; resume with:\n  %s",
                 summary.get("train_steps"), resume_command(job.overrides, os.path.abspath(run_dir)))


def report_config_error(message: str) -> None:
    """A refused config, said once: every rank of a launcher's world sees the same error, so rank 0 prints it.
    Under torchrun every rank also writes it into its error file, so that torchrun's report shows this line, as
    the root cause whichever rank it names, instead of a pointer to its docs."""
    line = f"nanoexp: {message}"
    env, error_file = launcher_env(), os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with open(error_file, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                  "timestamp": str(int(time.time()))}}}, f)
    if env is None or env["rank"] == 0:
        print(line, file=sys.stderr)


def keeps_its_summary(error: BaseException, run_dir: str, job: HydraJob) -> bool:
    """Whether a failed start leaves the run folder's summary.json as it is: a folder another run owns is never
    written into, a single run's bad config only prints, and a refused rerun of a finished run (too few
    tokens.train_steps, another run's checkpoint) keeps that run's results."""
    if isinstance(error, RunFolderBusy):
        return True
    if not isinstance(error, ConfigError):
        return False
    return not job.multirun or (read_summary(run_dir) or {}).get("status") == "completed"


def failure_line(error: BaseException) -> str:
    """A failed run's last line, the same on one process as from a launcher's workers: `rank R failed: <Type>: ...`."""
    if isinstance(error, WorkerFailed):   # the launcher named the rank
        return str(error)
    env = launcher_env()
    return f"rank {env['rank'] if env else 0} failed: {type(error).__name__}: {error}"


def main(cfg, run_dir: str, job: HydraJob | None = None) -> None:
    """train.py's body: one readable message and a non-zero exit for a bad config (2) or a runtime failure whose
    message names its cause (1, nanoexp/failures.py); other errors (bugs) bring their traceback.
    A failed job's summary.json says failed and why; in a multirun the error is raised instead of
    exiting, so Hydra marks this job failed and the sweep goes on with the others. A sweep job stopped
    by SIGTERM/SIGUSR2 exits without a result, so that no launcher takes it for finished. A single
    run refused at validation removes the run folder Hydra made for it."""
    job = job or HydraJob()
    try:
        run(cfg, run_dir, job)
    except StopBeforeTraining as stop:   # one line (rank 0's), the signal's exit code: 130 for Ctrl-C, 143 for SIGTERM
        env = launcher_env()
        if env is None or env["rank"] == 0:
            print(f"nanoexp: {stop}", file=sys.stderr)
        sys.exit(stop.exit_code)
    except Exception as error:
        if not keeps_its_summary(error, run_dir, job):
            record_failure(run_dir, error)
        if job.multirun or not (isinstance(error, ConfigError) or is_known(error)):
            raise
        if not isinstance(error, ConfigError):   # a runtime failure that names its cause: one line, no traceback
            if os.environ.get("HYDRA_FULL_ERROR") == "1" and not isinstance(error, WorkerFailed):
                raise
            print(f"nanoexp: {failure_line(error)}", file=sys.stderr)
            sys.exit(1)
        if job.created_folder:
            remove_run_folder(job.created_folder)
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        report_config_error(str(error))
        sys.exit(2)
    report_end(run_dir, job)
    if job.multirun and stopped_by_signal(run_dir):   # unfinished: SLURM requeues it, or the sweep reports it
        raise SystemExit("nanoexp: stopped by a signal after checkpointing; this sweep job is not finished")
