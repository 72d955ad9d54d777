"""The peak matmul throughput MFU divides by (nanoexp/observe/peak.py): the GPU datasheet table, the CPU node's
measured peak (the best this machine measured, cached; measured at each start until the day's figure is stable,
within a time budget, in a child process), an MFU that cannot pass 100 % (one rate above the peak: no MFU anywhere),
FP8 in software reporting no MFU, and the warning for a dtype the CPU computes far slower than float32."""
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from nanoexp.parallel.context import ParallelContext
from nanoexp.observe import peak
from nanoexp.observe.peak import Peak, job_peak, measure_apart, measure_cpu_peak, node_peak, peak_dtype, \
    slow_dtype_warning, sum_of_node_peaks
from nanoexp.runtime.trainer import Trainer
from tests.helpers import FAST, compose_config


def test_peak_table_matches_names_and_dtypes(monkeypatch):
    gpu = torch.device("cuda", 0)   # only the device type is read; no GPU needed
    for name, dtype, peak in [("NVIDIA H200", "bfloat16", 989.0), ("NVIDIA H100 80GB HBM3", "bfloat16", 989.0),
                              ("NVIDIA H100 PCIe", "bfloat16", 756.0), ("NVIDIA A100-SXM4-80GB", "float32", 19.5),
                              ("NVIDIA H200", "float8", 1979.0), ("NVIDIA H100 PCIe", "float8", 1513.0),
                              ("NVIDIA A100-SXM4-80GB", "float8", None), ("NVIDIA H100 NVL", "bfloat16", 835.5),
                              ("NVIDIA H100 NVL", "float8", 1670.5), ("NVIDIA H100 80GB HBM3", "tfloat32", 494.5),
                              ("NVIDIA H100 NVL", "tfloat32", 417.5),
                              ("NVIDIA GeForce RTX 4090", "bfloat16", None)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        job = job_peak(gpu, dtype, None, world_size=8, nodes=1)
        assert job.tflops == (None if peak is None else 8 * peak), name   # per GPU x GPUs
    assert job_peak(gpu, "bfloat16", 100.0, world_size=4, nodes=1).tflops == 400.0


def test_cpu_peak_is_per_node_and_measured_without_the_training_rng():
    """On CPU the ranks of a node share its cores: the job's peak is the node's times the nodes, not
    times the ranks. The measurement draws no random numbers (the training RNG stays where it was)."""
    cpu = torch.device("cpu")
    assert job_peak(cpu, "float32", None, world_size=8, nodes=1).tflops is None   # nothing measured
    assert job_peak(cpu, "float32", 2.5, world_size=8, nodes=2).tflops == 5.0
    torch.manual_seed(0)
    before = torch.get_rng_state()
    threads = torch.get_num_threads()
    measured = measure_cpu_peak("float32", threads=2)
    assert torch.equal(torch.get_rng_state(), before) and torch.get_num_threads() == threads
    # Positive and finite: a lower bound would make the verdict depend on the CPU's speed and load (a loaded
    # 2-core machine measured 12.5 MFLOP/s once); no CPU reaches 1 PFLOP/s.
    assert 0 < measured.tflops < 1e3 and re.search(r"best of 3 \d+x\d+ float32 matmuls on 2 threads", measured.source)
    job = job_peak(cpu, "float32", None, world_size=4, nodes=1, measured=sum_of_node_peaks([measured, None, None]))
    assert job.tflops == measured.tflops and "x 1 node" in job.source
    # several nodes: each node's first rank measures its own, and the job's peak is their sum
    two = sum_of_node_peaks([Peak(0.2, "node 0"), None, Peak(0.1, "node 1"), None])
    assert two.tflops == pytest.approx(0.3) and "the sum of 2 nodes' peaks" in two.source
    assert sum_of_node_peaks([None, None]) is None


def test_the_node_peak_is_the_best_this_machine_measured(tmp_path):
    """A measurement on a busy machine reads low: the peak is the best figure kept for this machine, CPU, thread
    count and dtype, and a better new measurement replaces it."""
    cache = str(tmp_path / "peaks.json")
    first = node_peak("float32", 1, cache)
    key = next(iter(json.load(open(cache))))
    assert "threads" in key and "float32" in key and first.tflops == json.load(open(cache))[key]["tflops"]
    json.dump({key: {"tflops": 1e6, "date": "2026-01-01"}}, open(cache, "w"))   # a figure no CPU reaches
    kept = node_peak("float32", 1, cache)
    assert kept.tflops == 1e6 and "this machine's best float32 measurement on 1 threads (2026-01-01" in kept.source
    json.dump({key: {"tflops": 1e-9, "date": "2026-01-01"}}, open(cache, "w"))   # beaten at once
    assert node_peak("float32", 1, cache).tflops > 1e-9 and json.load(open(cache))[key]["tflops"] > 1e-9


def measured_in_turn(monkeypatch, figures: list[float]) -> list[float]:
    """measure_apart gives these TFLOP/s, one a start; returns what is left of them (a start that measured took
    one)."""
    left = list(figures)
    monkeypatch.setattr(peak, "measure_apart", lambda dtype, threads: Peak(left.pop(0), "measured: a test's"))
    return left


def test_a_busy_minute_does_not_spoil_the_days_peak(tmp_path, monkeypatch):
    """The first start of a day on a new machine measures under load (45 GFLOP/s where it reaches 130 idle): the
    next start measures again and the better figure wins; once two of the day's best agree within STABLE, later
    starts take it without measuring."""
    cache = str(tmp_path / "peaks.json")
    left = measured_in_turn(monkeypatch, [0.045, 0.13, 0.128])
    assert [node_peak("float32", 1, cache).tflops for _ in range(5)] == [0.045, 0.13, 0.13, 0.13, 0.13]
    assert left == []   # three measurements, then none: 0.13 and 0.128 agree
    again = node_peak("float32", 1, cache)
    assert again.tflops == 0.13 and "today's figure is stable, not measured again today" in again.source


def test_a_machine_busy_all_day_stops_measuring_after_a_few_starts(tmp_path, monkeypatch):
    cache = str(tmp_path / "peaks.json")
    figures = [0.05, 0.08, 0.11, 0.14, 0.2]   # never two within 5 %
    left = measured_in_turn(monkeypatch, figures)
    assert [node_peak("float32", 1, cache).tflops for _ in range(6)] == [0.05, 0.08, 0.11, 0.14, 0.14, 0.14]
    assert left == figures[peak.DAILY_MEASUREMENTS:]


def test_yesterdays_stable_figure_is_measured_again_today(tmp_path, monkeypatch):
    """A new day starts a new series (the best ever still counts): a machine that got faster shows it."""
    cache = str(tmp_path / "peaks.json")
    measured_in_turn(monkeypatch, [0.13, 0.13])
    node_peak("float32", 1, cache), node_peak("float32", 1, cache)
    stored = json.load(open(cache))
    for entry in stored.values():
        entry["measured"] = "2026-01-01"
    json.dump(stored, open(cache, "w"))
    measured_in_turn(monkeypatch, [0.1])
    today = node_peak("float32", 1, cache)
    assert today.tflops == 0.13 and "now 0.1 TFLOP/s" in today.source   # measured, the best kept


def test_a_throughput_above_the_peak_is_never_reported_as_mfu(caplog):
    """One rate above the peak shows it wrong: no MFU from then on, also for rates below it (the summary's mean
    among them: a sweep job once warned so, then printed MFU 90.3 % in its summary line and the sweep table)."""
    cfg = compose_config(FAST)
    trainer = Trainer(cfg, ParallelContext(), os.devnull, peak=Peak(2.0, "a test's peak"))
    trainer.batches.close()
    assert trainer.reporter.mfu(1.0) == 0.5
    with caplog.at_level("WARNING", logger="nanoexp"):
        assert trainer.reporter.mfu(3.0) is None and trainer.reporter.mfu(4.0) is None and trainer.reporter.mfu(1.8) is None
    assert sum("above the peak" in r.getMessage() for r in caplog.records) == 1   # said once


@pytest.mark.slow
def test_a_run_that_shows_its_peak_wrong_reports_no_mfu_anywhere(tmp_path):
    """A peak far below what the model reaches (logging.peak_tflops=1e-9): no MFU in metrics.jsonl, summary.json
    (which says peak_refuted), the closing summary line or the sweep table."""
    from nanoexp.launch.sweep_report import COLUMNS, job_row, table
    from nanoexp.observe.console import summary_line
    from nanoexp.observe.summary import read_summary
    from tests.helpers import train
    records = train(tmp_path / "0", FAST + ["tokens.train_steps=3", "tokens.val_check_interval=0",
                                            "logging.peak_tflops=1e-9"])
    assert [r["mfu"] for r in records if "loss" in r] == [None] * 3
    summary = read_summary(str(tmp_path / "0"))
    assert summary["mfu"] is None and summary["peak_refuted"] is True
    assert "| MFU - (the peak is wrong) |" in summary_line(summary, "summary.json")
    row, _ = job_row(str(tmp_path), 0, None)
    header, line = table([row], COLUMNS).splitlines()
    assert line[header.index("mfu"):].split()[0] == "-"


def test_a_dtype_far_slower_than_float32_is_warned_about():
    float32 = Peak(0.2, "float32's")
    assert slow_dtype_warning("float32", Peak(1.0, ""), float32) is None
    warning = slow_dtype_warning("bfloat16", Peak(1e-9, "a tiny bf16 peak"), float32)
    assert "model.dtype=bfloat16" in warning and "slower than float32" in warning
    assert slow_dtype_warning("bfloat16", Peak(1e6, "a huge bf16 peak"), float32) is None


def test_fp8_runs_are_measured_against_the_peak_of_the_matmuls_that_run():
    """model.fp8 moves nearly all of the FLOPs into its products: on FP8 units MFU divides by the FP8 peak (a GPU's
    datasheet figure above; on a CPU forced to torch._scaled_mm, its measured rate, and a CPU much slower in FP8
    than in float32 says so); emulated, they are float32 matmuls, and so is the peak."""
    assert peak_dtype(compose_config(FAST)) == "float32"
    assert peak_dtype(compose_config(FAST + ["model.fp8.enabled=true"])) == "float32"   # a CPU: emulated
    assert peak_dtype(compose_config(FAST + ["model.fp8.enabled=true", "model.dtype=bfloat16"])) == "float32"
    assert peak_dtype(compose_config(FAST + ["model.fp8.enabled=true", "model.fp8.emulate=false"])) == "float8"
    measured = measure_cpu_peak("float8", threads=1, max_size=128)
    assert 1e-6 < measured.tflops < 1e3 and "float8 matmuls on 1 threads" in measured.source
    warning = slow_dtype_warning("float8", Peak(1e-9, "a tiny FP8 peak"), Peak(0.2, "float32's"))
    assert warning.startswith("model.fp8.emulate=false") and "model.fp8.emulate=null is faster" in warning


def test_fp8_in_software_on_a_cpu_reports_no_mfu():
    """FP8 products on a CPU (model.fp8.emulate=false: torch._scaled_mm in software, 0.0008 TFLOP/s where float32
    reaches 0.2) have no FP8 units' peak to be measured against: the peak is withheld, its source says why, and the
    job's peak keeps that reason; a CPU as fast in FP8 as in float32 would keep its peak."""
    float32 = Peak(0.2, "float32's")
    withheld = peak.mfu_peak("float8", Peak(0.0008, "measured: float8"), float32)
    assert withheld.tflops is None and withheld.source == (
        "none: this CPU's float8 matmuls run in software at 0.8 GFLOP/s, 250x slower than float32's, so no MFU is "
        "reported (it would measure against no FP8 units); model.fp8.emulate=null computes in float32 and reports it")
    job = job_peak(torch.device("cpu"), "float8", None, 2, 1, sum_of_node_peaks([withheld, None]))
    assert job == withheld
    assert peak.mfu_peak("float8", Peak(0.3, "fast FP8"), float32).tflops == 0.3
    assert peak.mfu_peak("bfloat16", Peak(0.001, "slow bf16"), float32).tflops == 0.001   # warned of, still its peak


def test_a_slow_dtype_is_measured_within_the_budget(monkeypatch):
    """A CPU whose FP8 products run at 0.03 GFLOP/s (0.14 s at 128², 1.1 s at 256²; seen on a 2-core Xeon) is
    measured in about a second, on the sizes that fit, instead of minutes at 2048²."""
    def slow_product(a, b):
        seconds = 2 * a.shape[0] ** 3 / 3e7
        time.sleep(seconds)
        return seconds

    monkeypatch.setattr(peak, "_timed_mm", slow_product)
    start = time.perf_counter()
    measured = measure_cpu_peak("float8", threads=1)
    assert time.perf_counter() - start < 2.0
    assert measured.tflops == pytest.approx(3e-5) and "128x128 float8" in measured.source


def test_the_start_up_measurement_runs_in_a_child_process(monkeypatch):
    """measure_apart measures in a forked child: this process runs no long matmul (it answers signals throughout)
    and starts no OpenMP threads (which would hang a worker forked later that uses several)."""
    monkeypatch.setitem(peak._FORK, "safe", True)   # one thread in the child: safe whatever this process ran
    monkeypatch.setattr(peak, "measure_cpu_peak", lambda dtype, threads: Peak(1.5, f"{dtype} in {os.getpid()}"))
    measured = measure_apart("float32", 1)
    assert measured.tflops == 1.5 and measured.source.startswith("float32 in ")
    assert measured.source != f"float32 in {os.getpid()}"


# In a process of its own: it leaves that process with two OpenMP threads.
AFTER_PARALLEL_OPS = """
import os, time, torch
from nanoexp.observe import peak
torch.set_num_threads(2)
torch.ones(1 << 20).sum()   # this process's OpenMP threads start: a child forked now hangs in its first parallel op
start = time.perf_counter()
measured = peak.measure_apart("float32", 2)
print(measured.tflops > 0, peak._FORK["safe"], round(time.perf_counter() - start, 1))
"""


@pytest.mark.slow
def test_a_process_that_ran_parallel_ops_measures_in_itself():
    """Where the forked child would hang (its parent has run parallel ops: a test session, a notebook), the
    measurement is made in this process after READY_S, and at once from then on."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", AFTER_PARALLEL_OPS], cwd=root, capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    assert out[:2] == ["True", "False"] and float(out[2]) < peak.READY_S + 3
