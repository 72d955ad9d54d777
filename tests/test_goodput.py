"""Goodput (nanoexp/plan/goodput.py and scripts/plan.py's table): the failure rate of the Llama 3 run, Young-Daly's
interval, and the lost time with restarts against replica groups, each against a hand computation."""
import json
import math

import pytest

from nanoexp.plan.goodput import (LLAMA3_GPU_HOURS_PER_FAILURE, job_mtbf_s, replica_goodput, restart_goodput,
                                  young_daly_interval_s)


def test_the_llama3_failure_rate():
    """419 interruptions in 54 days on 16,384 GPUs: a 512-GPU job fails about every 4 days, a 4,096-GPU one about
    every 12 hours (the figures of issue 66)."""
    assert LLAMA3_GPU_HOURS_PER_FAILURE == pytest.approx(50_678, abs=1)
    assert job_mtbf_s(512) / 86_400 == pytest.approx(4.12, abs=0.01)
    assert job_mtbf_s(4096) / 3600 == pytest.approx(12.37, abs=0.01)


def test_young_daly_and_the_time_lost():
    save, mtbf, restart = 30.0, 86_400.0, 600.0
    interval = young_daly_interval_s(save, mtbf)
    assert interval == pytest.approx(math.sqrt(2 * save * mtbf) - save)   # 2,247 s
    lost = save / interval + (interval / 2 + restart) / mtbf
    assert restart_goodput(save, restart, mtbf) == pytest.approx(1 - lost)
    for other in (interval / 2, interval * 2):   # the interval that loses least
        assert restart_goodput(save, restart, mtbf, other) < restart_goodput(save, restart, mtbf)
    # 8 groups: a failure stops all for 5 s and one group for 10 minutes
    assert replica_goodput(5.0, restart, 8, mtbf) == pytest.approx(1 - (5 + restart / 8) / mtbf)
    assert replica_goodput(5.0, restart, 8, mtbf) > restart_goodput(save, restart, mtbf)


def test_the_planner_prints_and_writes_goodput(capsys):
    from nanoexp.plan.cli import main
    assert main(["model=tiny", "--gpus", "4", "--top", "2", "--mtbf-gpu-hours", "100"]) == 0
    out = capsys.readouterr().out
    assert "goodput, a failure every 100 GPU-hours: 0.96 a day" in out   # 24 x 4 / 100
    assert main(["model=tiny", "--gpus", "4", "--top", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert all(0 < row["goodput"]["restart"] <= row["goodput"]["replica_groups"] <= 1 for row in rows)


def test_a_bad_failure_rate_is_one_line(capsys):
    from nanoexp.plan.cli import main
    assert main(["model=tiny", "--gpus", "4", "--mtbf-gpu-hours", "0"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--mtbf-gpu-hours" in err
