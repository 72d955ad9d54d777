"""Replica groups (fault_tolerance=torchft) measured: the parity table, the failure table and DiLoCo's loss and bytes.

    python benchmarks/bench_replica_groups.py parity                 # R=2 groups against the plain run, 5 layouts
    python benchmarks/bench_replica_groups.py failures --minutes 3   # a group killed every T s, both recoveries
    python benchmarks/bench_replica_groups.py diloco --steps 120     # DiLoCo against synchronous, model=small
    python benchmarks/bench_replica_groups.py hosts --steps 40       # the bytes across two fake hosts (root)

parity: each case trains 4 steps as R=2 groups and as the plain run of the same global batch (dp = 2 x the group's);
the table gives the largest relative loss difference, the largest weight difference (final checkpoints) and whether
every rank of both groups ended with the same state (summary.json's state_crc32); the last row is a run in which
group 1 is killed in step 3 and heals from group 0 (min_replicas=2), against the failure-free run.

failures: `train.py` runs for --minutes each way, with a worker SIGKILLed every T seconds (T in --periods): as 2
replica groups (the launcher restarts the killed group, which heals from the live one), and as one torchrun world
of the same ranks (`--max-restarts`, asynchronous checkpoints every N steps, N from Young-Daly's rule with the
failure-free run's save stall and T as the MTBF: nanoexp/plan/goodput.py). Committed steps per minute (the last step
reached, over the time) and tokens trained (the last consumed_tokens: with groups, a step without one trains less),
against each path's failure-free run; the median time from a kill to the killed group's (torchrun: the world's)
first step after it, from the log lines' time stamps.

diloco: model=small, the same tokens, synchronous groups against DiLoCo (sync_every H): the held-out loss at the end,
and the payload each rank all-reduced across groups per step (summary.json's fault_tolerance.cross_group_bytes over
the steps), counted by the run itself.

hosts: the same two ways of training, group 0 and the lighthouse on fake host 0, group 1 on fake host 1
(scripts/fake_hosts.sh up 2, as root): the bytes host 1's link carried (its veth's end on the bridge, received and
sent, from /sys/class/net/nxh1/statistics) over the run, per step, beside the run's own count; the link's bytes
over 10 s before each run say what else crosses it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # run as a file: the repository root

from nanoexp.plan.goodput import young_daly_interval_s  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["model.model_config.hidden_size=64", "model.model_config.intermediate_size=128",
         "model.model_config.num_hidden_layers=4", "model.model_config.num_attention_heads=4",
         "model.model_config.num_key_value_heads=2", "tokens.sequence_length=32", "tokens.global_batch_size=8",
         "tokens.micro_batch_size=2", "tokens.limit_val_batches=2", "logging.tensorboard=false",
         "data.prefetch=false", "optimizer.learning_rate_scheduler.lr_warmup_steps=2"]
TORCHFT = ["fault_tolerance=torchft"]
PARITY = {"dp2 groups vs dp4": ("dp4tp1pp1", "dp2tp1pp1", []), "tp2 groups vs dp2tp2": ("dp2tp2pp1", "dp1tp2pp1", []),
          "pp2 groups vs dp2pp2": ("dp2tp1pp2", "dp1tp1pp2", []),
          "ZeRO-1 dp2 groups vs dp4": ("dp4tp1pp1", "dp2tp1pp1", ["optimizer.zero_stage=1"]),
          "ZeRO-3 dp2 groups vs dp4": ("dp4tp1pp1", "dp2tp1pp1", ["optimizer.zero_stage=3"])}


def train_py(run_dir: str, overrides: list[str], timeout: float = 1800) -> None:
    command = [sys.executable, os.path.join(ROOT, "train.py"), *overrides, f"hydra.run.dir={run_dir}"]
    subprocess.run(command, check=True, cwd=ROOT, timeout=timeout, stdout=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONPATH": ROOT})


def records(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def weights(run_dir: str) -> dict:
    from nanoexp.checkpoint.load import CheckpointReader
    folder = os.path.join(run_dir, "checkpoints")
    reader = CheckpointReader(os.path.join(folder, open(os.path.join(folder, "latest.txt")).read().strip()))
    return {name: reader.full_tensor(name) for name in reader.full_shapes()}


def compare(plain_dir: str, ft_dir: str) -> tuple[float, float, bool]:
    """(largest relative loss difference, largest weight difference, every group's state the same)."""
    plain, ft = ([r["loss"] for r in records(d) if "loss" in r] for d in (plain_dir, ft_dir))
    loss = max(abs(a - b) / abs(a) for a, b in zip(plain, ft)) if len(plain) == len(ft) else float("nan")
    ours, theirs = weights(ft_dir), weights(plain_dir)
    weight = max(float((ours[name] - theirs[name]).abs().max()) for name in theirs)
    digests = [json.load(open(os.path.join(ft_dir, g, "summary.json")))["state_crc32"]
               for g in sorted(os.listdir(ft_dir)) if g.startswith("group_")]
    return loss, weight, all(d == digests[0] for d in digests)


def main_parity(args) -> None:
    work = tempfile.mkdtemp(prefix="bench-ft-parity-")
    run = SMALL + ["tokens.train_steps=4", "tokens.val_check_interval=0"]
    rows = []
    for name, (plain, groups, extra) in PARITY.items():
        train_py(f"{work}/{name}/plain", run + extra + [f"parallelism={plain}"])
        train_py(f"{work}/{name}/ft", run + extra + [f"parallelism={groups}"] + TORCHFT)
        rows.append((name, *compare(f"{work}/{name}/plain", f"{work}/{name}/ft")))
    run = SMALL + ["tokens.train_steps=6", "tokens.val_check_interval=0"]
    train_py(f"{work}/heal/plain", run + ["parallelism=dp2tp1pp1"])
    train_py(f"{work}/heal/ft", run + TORCHFT + ["fault_tolerance.min_replicas=2", "fault_injection.kill_group=1",
                                                 "fault_injection.kill_at_step=3"])
    rows.append(("dp1 groups, group 1 killed in step 3, healed", *compare(f"{work}/heal/plain", f"{work}/heal/ft")))
    print("| case | max rel. loss diff | max weight diff | groups' states identical |\n|---|---|---|---|")
    for name, loss, weight, same in rows:
        print(f"| {name} | {loss:.1e} | {weight:.1e} | {'yes' if same else 'NO'} |")
    shutil.rmtree(work, ignore_errors=True)


# -- failures ---------------------------------------------------------------------------------------------------
LOG_TIME = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]\[rank 0 .*\] step (\d+)/")


def step_times(log_path: str) -> list[tuple[float, int]]:
    """(wall time, step) of each step line of a rank-0 log."""
    out = []
    for line in open(log_path) if os.path.exists(log_path) else ():
        match = LOG_TIME.match(line)
        if match:
            stamp = datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append((stamp, int(match.group(2))))
    return out


def workers(root_pid: int, group_log: str | None) -> list[psutil.Process]:
    """The training processes under `root_pid` (with `group_log`: the one writing it, its group's rank 0)."""
    found = []
    for child in psutil.Process(root_pid).children(recursive=True):
        try:
            files = [f.path for f in child.open_files()]
        except psutil.Error:
            continue
        if any(path.endswith(os.path.join("logs", "rank_0.log")) or path.endswith("rank_1.log") for path in files):
            if group_log is None or group_log in files:
                found.append(child)
    return found


def run_with_kills(command: list[str], run_dir: str, minutes: float, period: float | None, groups: bool) -> dict:
    """Start `command`, SIGKILL a training process every `period` s (groups: alternately group 1's and group 0's
    rank 0), stop after `minutes`; the last step reached and each kill's time to the next step of the killed part."""
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, "PYTHONPATH": ROOT}, start_new_session=True)
    kills, start = [], time.time()
    try:
        while not any(step_times(log) for log in logs(run_dir, groups)) and process.poll() is None:
            time.sleep(0.5)
        start, next_kill = time.time(), time.time() + (period or 1e9)
        while time.time() < start + minutes * 60 and process.poll() is None:
            time.sleep(0.2)
            if time.time() >= next_kill:
                target = logs(run_dir, groups)[len(kills) % 2 == 0] if groups else None
                victims = workers(process.pid, target)
                if victims:
                    victims[0].send_signal(signal.SIGKILL)
                    kills.append((time.time(), target))
                next_kill += period
        end = time.time()
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    last = max((step for log in logs(run_dir, groups) for _, step in step_times(log)), default=0)
    tokens = max((r.get("consumed_tokens", 0) for folder in metrics_folders(run_dir, groups)
                  for r in records(folder)), default=0)
    rejoin = []
    for moment, target in kills:
        after = [t for log in ([target] if target else logs(run_dir, groups)) for t, _ in step_times(log) if t > moment]
        if after:
            rejoin.append(min(after) - moment)
    return {"steps_per_min": last / (end - start) * 60, "rejoin_s": statistics.median(rejoin) if rejoin else None,
            "kills": len(kills), "tokens_per_min": tokens / (end - start) * 60}


def metrics_folders(run_dir: str, groups: bool) -> list[str]:
    folders = [os.path.join(run_dir, f"group_{g}") for g in (0, 1)] if groups else [run_dir]
    return [folder for folder in folders if os.path.exists(os.path.join(folder, "metrics.jsonl"))]


def logs(run_dir: str, groups: bool) -> list[str]:
    if groups:
        return [os.path.join(run_dir, f"group_{g}", "logs", "rank_0.log") for g in (0, 1)]
    return [os.path.join(run_dir, "logs", "rank_0.log")]


def save_stall(run_dir: str) -> float:
    stalls = [r["checkpoint/stall_sec"] for r in records(run_dir) if "checkpoint/stall_sec" in r]
    return statistics.median(stalls) if stalls else 0.05


def main_failures(args) -> None:
    work = tempfile.mkdtemp(prefix="bench-ft-failures-")
    shape = ["model=tiny", "tokens.sequence_length=128", "tokens.global_batch_size=8", "tokens.micro_batch_size=2",
             "tokens.val_check_interval=0", "logging.tensorboard=false", "logging.iteration_step_info_interval=1",
             "checkpoint.save_final_state=false", "optimizer.learning_rate_scheduler.lr_warmup_steps=2"]
    run = shape + ["tokens.train_steps=100000", f"fault_injection.slow_step_s={args.slow_step_s}"]
    ft = [sys.executable, os.path.join(ROOT, "train.py"), *run, *TORCHFT, "fault_tolerance.max_restarts=1000",
          "checkpoint.checkpoint_interval=0"]
    probe = f"{work}/probe"   # the failure-free save stall, for Young-Daly's interval
    train_py(probe, shape + ["tokens.train_steps=6", "checkpoint.checkpoint_interval=2", "checkpoint.async_save=true",
                             "parallelism=dp2tp1pp1"])
    stall = save_stall(probe)

    def torchrun(interval: int) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                "--max-restarts=1000", os.path.join(ROOT, "train.py"), *run, "parallelism=dp2tp1pp1",
                "checkpoint.async_save=true", f"checkpoint.checkpoint_interval={interval}"]
    base_ft = run_with_kills(ft + [f"hydra.run.dir={work}/ft_free"], f"{work}/ft_free", args.minutes, None, True)
    base_restart = run_with_kills(torchrun(10) + [f"hydra.run.dir={work}/tr_free"], f"{work}/tr_free", args.minutes,
                                  None, False)
    print(f"save stall {stall:.3f} s (async, dp2); failure-free: groups {base_ft['steps_per_min']:.0f} steps/min, "
          f"one world {base_restart['steps_per_min']:.0f} steps/min; load average {os.getloadavg()[0]:.1f}")
    print("| T (s) | path | checkpoint every | kills | committed steps/min | vs failure-free | tokens trained vs "
          "failure-free | kill -> first step of the killed part (median) |\n|---|---|---|---|---|---|---|---|")
    for period in args.periods:
        step_s = 60 / base_restart["steps_per_min"]
        interval = max(1, round(young_daly_interval_s(stall, period) / step_s))
        for path, command, base in [("replica groups", ft, base_ft), ("restart from checkpoint", torchrun(interval),
                                                                      base_restart)]:
            folder = f"{work}/{path.split()[0]}_{period}"
            result = run_with_kills(command + [f"hydra.run.dir={folder}"], folder, args.minutes, period,
                                    path == "replica groups")
            every = "end only" if path == "replica groups" else f"{interval} steps"
            rejoin = f"{result['rejoin_s']:.1f} s" if result["rejoin_s"] is not None else "-"
            print(f"| {period:g} | {path} | {every} | {result['kills']} | {result['steps_per_min']:.0f} | "
                  f"{result['steps_per_min'] / base['steps_per_min']:.2f} | "
                  f"{result['tokens_per_min'] / base['tokens_per_min']:.2f} | {rejoin} |", flush=True)
    shutil.rmtree(work, ignore_errors=True)


# -- DiLoCo ------------------------------------------------------------------------------------------------------
def main_diloco(args) -> None:
    work = tempfile.mkdtemp(prefix="bench-ft-diloco-")
    run = ["model=small", f"tokens.train_steps={args.steps}", f"tokens.val_check_interval={args.steps}",
           "tokens.global_batch_size=16", "tokens.micro_batch_size=4", "tokens.limit_val_batches=8",
           "logging.tensorboard=false", "checkpoint.checkpoint_interval=0", *TORCHFT]
    rows = []
    for name, extra in [("synchronous", []), (f"diloco_H{args.sync_every}", [
            "fault_tolerance.semi_sync=diloco", f"fault_tolerance.sync_every={args.sync_every}"])]:
        start = time.time()
        train_py(f"{work}/{name}", run + extra, timeout=24 * 3600)
        summary = json.load(open(f"{work}/{name}/group_0/summary.json"))
        rows.append((name, summary["eval_loss"], summary["fault_tolerance"]["cross_group_bytes"] / args.steps,
                     summary["consumed_tokens"], time.time() - start))
    print(f"model=small, {args.steps} steps of 16 x 128 tokens, 2 groups; load average {os.getloadavg()[0]:.1f}")
    print("| training | eval loss | cross-group bytes per step per rank | tokens | wall |\n|---|---|---|---|---|")
    for name, loss, sent, tokens, wall in rows:
        print(f"| {name} | {loss:.4f} | {sent / 2**20:.2f} MiB | {tokens:,} | {wall / 60:.0f} min |")
    shutil.rmtree(work, ignore_errors=True)


# -- bytes across the fake hosts ---------------------------------------------------------------------------------
LINK = "/sys/class/net/nxh1/statistics"   # host 1's veth, its end on the bridge: all host 1 sends and receives
HOST_PORT = 29518


def link_bytes() -> int:
    return sum(int(open(os.path.join(LINK, f"{way}_bytes")).read()) for way in ("rx", "tx"))


def on_host(host: int, command: list[str], log) -> subprocess.Popen:
    return subprocess.Popen(["bash", os.path.join(ROOT, "scripts", "fake_hosts.sh"), "run", str(host), *command],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})


def groups_on_hosts(run_dir: str, overrides: list[str]) -> None:
    """The lighthouse and group 0 on host 0, group 1 on host 1 (as tests/test_replica_hosts.py), to the end."""
    lighthouse = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    group = [sys.executable, "train.py", *overrides, f"fault_tolerance.lighthouse=http://nanoexp-host0:{HOST_PORT}",
             f"hydra.run.dir={run_dir}"]
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "hosts.log"), "w") as log:
        server = on_host(0, [lighthouse, "--min_replicas", "2", "--bind", f"[::]:{HOST_PORT}",
                             "--heartbeat_timeout_ms", "2000"], log)
        try:
            groups = [on_host(k, group + [f"fault_tolerance.group={k}"], log) for k in (0, 1)]
            codes = [process.wait(timeout=24 * 3600) for process in groups]
        finally:
            server.terminate()
            server.wait()
    if codes != [0, 0]:
        sys.exit(f"groups exited {codes}: {os.path.join(run_dir, 'hosts.log')}")


def main_hosts(args) -> None:
    if not os.path.exists(LINK):
        sys.exit(f"no {LINK}: bring the fake hosts up first (bash scripts/fake_hosts.sh up 2, as root)")
    work = tempfile.mkdtemp(prefix="bench-ft-hosts-")
    run = ["model=small", f"tokens.train_steps={args.steps}", "tokens.val_check_interval=0",
           "tokens.global_batch_size=16", "tokens.micro_batch_size=4", "logging.tensorboard=false",
           "checkpoint.checkpoint_interval=0", *TORCHFT, "fault_tolerance.min_replicas=2"]
    rows = []
    for name, extra in [("synchronous", []), (f"DiLoCo, H = {args.sync_every}", [
            "fault_tolerance.semi_sync=diloco", f"fault_tolerance.sync_every={args.sync_every}"])]:
        idle = link_bytes()
        time.sleep(10)
        idle, before, start = link_bytes() - idle, link_bytes(), time.time()
        groups_on_hosts(f"{work}/{len(rows)}", run + extra)
        crossed, wall = link_bytes() - before, time.time() - start
        counted = json.load(open(f"{work}/{len(rows)}/group_1/summary.json"))["fault_tolerance"]["cross_group_bytes"]
        rows.append((name, crossed / args.steps, counted / args.steps, idle / 10, wall))
    print(f"model=small, {args.steps} steps of 16 x 128 tokens, 2 groups of one rank on 2 fake hosts; "
          f"{datetime.date.today()}, load average {os.getloadavg()[0]:.1f}")
    print("| training | bytes across the hosts per step (host 1's link, both ways) | the run's count per step "
          "(group 1's all-reduce payload) | the link idle, before | wall |\n|---|---|---|---|---|")
    for name, crossed, counted, idle, wall in rows:
        print(f"| {name} | {crossed / 2**20:.2f} MiB | {counted / 2**20:.2f} MiB | {idle / 1024:.1f} KiB/s | "
              f"{wall / 60:.1f} min |")
    shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    sub.add_parser("parity")
    failures = sub.add_parser("failures")
    failures.add_argument("--minutes", type=float, default=3.0)
    failures.add_argument("--periods", type=float, nargs="+", default=[60.0, 20.0])
    failures.add_argument("--slow-step-s", type=float, default=0.3, help="added to each step, for steps of ~0.5 s")
    diloco = sub.add_parser("diloco")
    diloco.add_argument("--steps", type=int, default=120)
    diloco.add_argument("--sync-every", type=int, default=20)
    hosts = sub.add_parser("hosts")
    hosts.add_argument("--steps", type=int, default=40)
    hosts.add_argument("--sync-every", type=int, default=20)
    args = parser.parse_args()
    {"parity": main_parity, "failures": main_failures, "diloco": main_diloco, "hosts": main_hosts}[args.mode](args)


if __name__ == "__main__":
    main()
