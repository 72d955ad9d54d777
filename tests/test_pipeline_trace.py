"""The pipeline timeline (recorded by nanoexp/instruments/trace.py, read by nanoexp/verify/trace_analysis.py) and
scripts/plot_pipeline.py.

The bubble arithmetic is checked against an independent model of the schedule (the
dependency simulation in tests/test_pipeline.py, where the answer is known exactly); the
recorded trace of a real dp2 x pp2 interleaved run is checked for completeness, for
causality across ranks (which only holds if every rank's clock and events are right) and for
gradient buckets launched while backward was still running.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from nanoexp.parallel.context import ParallelContext
from nanoexp.parallel.layout import Layout
from nanoexp.parallel.pipeline import PipelineEngine
from nanoexp.instruments.trace import PipelineTrace
from nanoexp.verify.trace_analysis import bucket_overlap, measured_bubble, read_trace, theoretical_bubble
from tests.distributed import run_distributed
from tests.helpers import FAST, train
from tests.test_pipeline import (HIDDEN, MB_SIZE, chunk_layers, make_blocks, make_forward_step, make_micro_batches,
                                 simulate_interleaved)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def plot_pipeline(*args: str) -> subprocess.CompletedProcess:
    """scripts/plot_pipeline.py as a user runs it."""
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plot_pipeline.py"), *args],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("pp,v,m", [(4, 1, 8), (4, 2, 8), (2, 3, 4)])
def test_measured_bubble_of_an_ideal_schedule_is_the_theory(pp, v, m):
    # Equal chunk times and free communication: the only idle time is the pipeline's fill and drain.
    events = simulate_interleaved(pp, v, m)
    assert measured_bubble(events) == pytest.approx(theoretical_bubble(pp, m, v), abs=1e-12)
    assert theoretical_bubble(4, 8) == pytest.approx(3 / 11)        # (p-1)/(m+p-1)
    assert theoretical_bubble(4, 8, 2) == pytest.approx(3 / 19)     # (p-1)/(v*m+p-1)


def test_bucket_overlap_is_relative_to_the_last_backward():
    events = [{"kind": "backward", "start": 10.0, "end": 12.0},
              {"kind": "allreduce_launch", "chunk": 0, "bucket": 0, "in_backward": True, "start": 11.5, "end": 11.5},
              {"kind": "allreduce_wait", "chunk": 0, "bucket": 0, "start": 12.5, "end": 13.0}]
    (row,) = bucket_overlap(events)
    assert row["launch"] == pytest.approx(-0.5) and row["wait_start"] == pytest.approx(0.5)
    assert row["wait"] == pytest.approx(0.5) and row["in_backward"]


def _traced_1f1b_worker(rank, world_size, run_dir, num_micro):
    ctx = ParallelContext(Layout(pp=world_size))
    blocks = make_blocks()
    stage = nn.Sequential(*[blocks[i] for i in chunk_layers(ctx, 1)[0]])
    trace = PipelineTrace.for_run(run_dir, ctx)
    engine = PipelineEngine(ctx, "1f1b", trace=trace)
    for _ in range(2):
        engine.run(make_forward_step(ctx, [stage], num_micro), make_micro_batches(num_micro), (MB_SIZE, HIDDEN),
                   torch.float32)
        trace.end_step()
    trace.close()


def test_1f1b_trace_records_compute_and_communication(tmp_path):
    pp, m = 2, 4
    run_distributed(_traced_1f1b_worker, pp, str(tmp_path), m)
    metas, events = read_trace(tmp_path)
    assert [meta["pp_rank"] for meta in metas] == [0, 1]
    for r in range(pp):
        for step in (1, 2):
            mine = [e for e in events if e["rank"] == r and e["step"] == step]
            for kind in ("forward", "backward"):
                assert sorted(e["mb"] for e in mine if e["kind"] == kind) == list(range(m))
            assert all(e["start"] <= e["end"] for e in mine)
        # 1F1B's steady state sends and receives in one batch (see pipeline/schedules.py), posted at once and
        # waited for when the next op needs the received tensor
        labels = {e["kind"] for e in events if e["rank"] == r}
        assert ("post send_forward recv_backward" if r == 0 else "post send_backward recv_forward") in labels
        assert ("wait recv_backward" if r == 0 else "wait recv_forward") in labels


@pytest.mark.slow
def test_interleaved_run_trace_and_plot(tmp_path):
    pp, v, dp, steps = 2, 2, 2, 2
    m = 8 // (dp * 2)   # FAST: global batch 8, micro-batch 2
    train(tmp_path, FAST + [f"tokens.train_steps={steps}", "tokens.val_check_interval=0", "parallelism=dp2tp1pp2",
                            "parallelism.pp_engine=interleaved_1f1b", f"parallelism.pp_virtual_stages={v}",
                            "logging.pipeline_trace=true"])
    metas, events = read_trace(tmp_path)
    assert sorted(meta["rank"] for meta in metas) == [0, 1, 2, 3]
    assert all(meta["engine"] == "interleaved_1f1b" and meta["virtual_stages"] == v for meta in metas)
    assert {e["step"] for e in events} == set(range(1, steps + 1))   # evaluation is not traced

    for meta in metas:
        for step in range(1, steps + 1):
            mine = [e for e in events if e["rank"] == meta["rank"] and e["step"] == step]
            for kind in ("forward", "backward"):   # every (micro-batch, chunk) exactly once
                assert sorted((e["mb"], e["chunk"]) for e in mine if e["kind"] == kind) == \
                    [(i, c) for i in range(m) for c in range(v)]
            # Data parallelism: every chunk's bucket is launched from backward's hooks and
            # waited for afterwards; the later chunk's gradients are final (and launched)
            # before this rank's last backward ends: communication overlapping compute.
            overlap = {row["chunk"]: row for row in bucket_overlap(mine)}
            assert sorted(overlap) == list(range(v))
            assert all(row["in_backward"] and row["wait_start"] >= row["launch"] for row in overlap.values())
            assert overlap[v - 1]["launch"] < 0

    # Causality across ranks: an activation leaves virtual stage s before stage s+1 uses it,
    # and gradients flow back the same way, on the shared wall clock.
    for dp_rank in range(dp):
        for step in range(1, steps + 1):
            at = {(e["kind"], e["chunk"] * pp + e["pp_rank"], e["mb"]): e for e in events
                  if e["dp_rank"] == dp_rank and e["step"] == step and e["kind"] in ("forward", "backward")}
            for i in range(m):
                for s in range(pp * v - 1):
                    assert at["forward", s, i]["end"] <= at["forward", s + 1, i]["start"]
                    assert at["backward", s + 1, i]["end"] <= at["backward", s, i]["start"]

    out = tmp_path / "timeline.png"
    result = plot_pipeline(str(tmp_path), "--out", str(out))
    assert result.returncode == 0, result.stderr
    printed = result.stdout
    assert out.stat().st_size > 10_000
    assert f"1F1B (p-1)/(m+p-1) = {theoretical_bubble(pp, m):.3f}" in printed
    assert f"interleaved (p-1)/(v*m+p-1) = {theoretical_bubble(pp, m, v):.3f}" in printed
    assert "bubble fraction, measured:" in printed and "DP gradient buckets" in printed
