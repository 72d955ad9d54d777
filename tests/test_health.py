"""Health checks (nanoexp/health/, docs/health.md): a slow rank is named, a spiking batch warned about, skipped or
rolled back (and a resume trains the same steps), a flipped gradient bit found by the replay check with its rank
and parameter; quiet runs find nothing and train exactly as without the checks. Each detector's fault comes from
nanoexp/launch/fault_injection.py."""
import json
import shutil
from collections import deque

import pytest
import torch

from nanoexp.config import ConfigError
from nanoexp.failures import KnownFailure
from nanoexp.health import Finding, install
from nanoexp.health.replay import digest
from nanoexp.health.spikes import Spikes
from nanoexp.health.stragglers import ComputeClock, Stragglers
from nanoexp.launch.sweep_report import health_findings, health_note
from nanoexp.launch.workers import WorkerFailed
from nanoexp.validation import validate
from tests.helpers import FAST, SLOW, compose_config, tiered, train, train_losses

RUN = FAST + ["tokens.val_check_interval=0"]


def findings(records: list[dict], kind: str) -> list[dict]:
    return [r for r in records if r.get("health/event") == kind]


# -- the verdicts, without training -------------------------------------------------------------
def test_compute_time_leaves_out_the_waits_for_collectives():
    clock = ComputeClock(torch.device("cpu"))
    marks = iter([0.0, 1.0, 5.0, 5.5, 6.0, 6.5])   # section from 0; a wait 1-5, one 5.5-6 (its work's); end 6.5
    clock.mark = lambda: next(marks)

    class Work(torch.distributed.Work):
        def wait(self, timeout=None):
            return True

    collective = clock.timed(lambda: Work())
    with clock.section():
        work = collective()   # a collective posted and waited for inside it: a wait of 4 s on the fake clock
        work.wait()           # and its work's wait: 0.5 s
    assert clock.read() == 6.5 - 4.0 - 0.5
    assert clock.read() == 0.0   # read once
    collective()   # outside a section: not counted
    assert clock.spans == []


def straggler_detector(factor: float, windows: int, stages: dict[int, list[int]]) -> Stragglers:
    detector = Stragglers.__new__(Stragglers)   # the verdict alone: no trainer, no process group
    world = sum(len(ranks) for ranks in stages.values())
    detector.factor, detector.windows, detector.every, detector.stages = factor, windows, 10, stages
    detector.in_a_row, detector.hosts = [0] * world, [f"host{r}" for r in range(world)]
    return detector


def test_a_rank_is_named_once_after_its_windows_in_a_row_against_its_stage():
    detector = straggler_detector(1.5, 2, {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]})
    slow_rank_1 = [1.0, 2.0, 1.1, 0.9, 3.0, 3.1, 2.9, 3.0]   # stage 1 does more work: no straggler there
    assert detector.judge(10, slow_rank_1) == []
    named = detector.judge(20, slow_rank_1)
    assert [(f.fields["rank"], f.fields["stage"], f.fields["median_s"]) for f in named] == [(1, 0, 1.0)]
    assert "rank 1 on host1 computes 2 s a step, 2.00x the median 1 s" in named[0].line
    assert detector.judge(30, slow_rank_1) == []   # named once a spell
    assert detector.judge(40, [1.0] * 8) == [] and detector.in_a_row[1] == 0
    two_ranks = straggler_detector(1.5, 1, {0: [0, 1]})
    assert [f.fields["rank"] for f in two_ranks.judge(10, [1.0, 1.6])] == [1]   # of two: against the faster one
    assert two_ranks.judge(20, [0.0, 5.0]) == []   # a rank without a timed step: no verdict


def spike_detector(window: list[float]) -> Spikes:
    detector = Spikes.__new__(Spikes)
    detector.losses = deque(enumerate(window), maxlen=len(window))
    return detector


def test_a_spike_is_judged_by_median_and_robust_deviation():
    detector = spike_detector([3.0, 3.1, 2.9, 3.05, 2.95])
    median, deviations = detector.judge(3.5)
    assert median == 3.0 and deviations == pytest.approx(0.5 / (1.4826 * 0.05))
    short = Spikes.__new__(Spikes)
    short.losses = deque([(1, 3.0)], maxlen=3)
    assert short.judge(9.0) == (None, None)   # the window is not full yet
    flat = spike_detector([2.0] * 5)   # no deviation: judged with 0.1 % of the median
    assert flat.judge(2.0)[1] == 0 and flat.judge(2.01)[1] == pytest.approx(5.0)


def test_one_flipped_bit_changes_the_digest():
    gradient = torch.randn(1000)
    flipped = gradient.clone()
    for bit in (0, 20, 31):
        flipped.copy_(gradient)
        flipped[7:8].view(torch.int32).bitwise_xor_(1 << bit)
        assert not torch.equal(digest(gradient), digest(flipped))
    assert torch.equal(digest(gradient), digest(gradient.clone()))
    assert torch.equal(digest(gradient.t()), digest(gradient))


@pytest.mark.parametrize("overrides, key", [
    (["health.straggler_factor=1.0"], "health.straggler_factor=1.0: must be above 1"),
    (["health.straggler_windows=0"], "health.straggler_windows=0: must be >= 1"),
    (["health.every=0"], "health.every=0"),
    (["health.spike.window=0"], "health.spike.window=0: must be >= 1"),
    (["health.spike.z=0"], "health.spike.z=0.0: must be positive"),
    (["health.spike.action=retry"], "health.spike.action=retry: allowed values are off, warn, skip, rollback"),
    (["health.spike.action=rollback"], "health.spike.action=rollback returns to the last checkpoint"),
    (["health.replay_every=2", "model.attention_kernel=flash"], "health.replay_every=2 compares two backwards"),
    (["health.replay_action=retry", "health.replay_every=1"], "health.replay_action=retry"),
    (["health.straggler_factor=2"], "health.straggler_factor=2.0 has no effect here"),   # one process
    (["health.replay_action=skip"], "health.replay_action=skip has no effect here"),
    (["health.spike.action=off", "health.spike.z=3"], "health.spike.z=3.0 has no effect here"),
])
def test_bad_health_settings_are_refused_naming_the_key(overrides, key):
    cfg = compose_config(RUN + overrides)
    with pytest.raises(ConfigError) as info:
        validate(cfg, world_size=cfg.parallelism.dp * cfg.parallelism.tp * cfg.parallelism.pp)
    assert key in str(info.value)


def test_nothing_is_installed_when_every_detector_is_off():
    assert install(compose_config(RUN + ["health.spike.action=off"]), trainer=None) is None   # one process
    assert install(compose_config(RUN + ["parallelism=dp2tp1pp1", "health.stragglers=false",
                                         "health.spike.action=off"]), trainer=None) is None


def test_the_sweep_report_names_the_runs_with_findings():
    quiet = {"health": {"stragglers": [], "spikes": [], "replay_mismatches": []}}
    spiky = {"health": {"stragglers": [{"rank": 1}], "spikes": [{"step": 3}, {"step": 9}], "replay_mismatches": []}}
    rows = [{"job": job, "health": health_findings(summary)} for job, summary in enumerate([{}, quiet, spiky])]
    assert health_note(rows) == "health findings (summary.json's health): job 2: stragglers 1, spikes 2"
    assert health_note(rows[:2]) is None
    assert Finding("spike", 3, "x", {"loss": 9.0}).record() == {
        "step": 3, "health/event": "spike", "health/message": "x", "health/loss": 9.0}


def test_a_finding_is_a_metrics_record_and_a_tensorboard_event(tmp_path):
    from nanoexp.observe.metrics import MetricsWriter
    writer = MetricsWriter(str(tmp_path), compose_config(RUN + ["logging.tensorboard=true"]))
    finding = Finding("straggler", 30, "straggler: rank 1 on node7 computes 2 s a step", {"rank": 1, "host": "node7"})
    writer.event(finding.record(), "health/straggler", finding.line)
    writer.close()
    assert [json.loads(line) for line in open(tmp_path / "metrics.jsonl")] == [finding.record()]
    events = b"".join(path.read_bytes() for path in (tmp_path / "tensorboard").iterdir())
    assert b"health/straggler" in events and b"rank 1 on node7" in events   # the text, and its tag
    assert b"health/rank" in events   # the numbers as scalars


# -- stragglers ----------------------------------------------------------------------------------
# The slowed rank and the layout: under tp, pp and ZeRO-3 its peers wait for it inside the forward and backward,
# and are not named (their waits for collectives are not their compute).
SLOWED = {"dp2": (1, ["parallelism=dp2tp1pp1"]), "dp2tp2": (0, ["parallelism=dp2tp2pp1"]),
          "dp2pp2": (0, ["parallelism=dp2tp1pp2"]), "zero3": (1, ["parallelism=dp2tp1pp1", "optimizer.zero_stage=3"])}


@pytest.mark.parametrize("layout", tiered(SLOWED, quick=[]))
def test_a_slow_rank_is_named_within_two_windows(layout, tmp_path):
    """The rank sleeps 50 ms in each micro-batch's forward: named at the end of the second window that times it
    (the first window's first step is warm-up, untimed), and no other rank is."""
    rank, overrides = SLOWED[layout]
    records = train(tmp_path, RUN + overrides + ["tokens.train_steps=8", "health.every=2", "health.straggler_windows=2",
                                                 f"fault_injection.slow_rank={rank}"])
    named = findings(records, "straggler")
    assert [(r["health/rank"], r["step"]) for r in named] == [(rank, 6)]
    assert named[0]["health/compute_s"] > 1.5 * named[0]["health/median_s"]
    summary = json.load(open(tmp_path / "summary.json"))
    assert [(s["rank"], s["step"]) for s in summary["health"]["stragglers"]] == [(rank, 6)]


@SLOW
def test_quiet_runs_name_no_straggler(tmp_path):
    """Four ranks on the suite's two loaded cores, the defaults but windows of 5 steps: the OS scheduler makes
    the ranks uneven, the verdict (a window's lower median, 1.5x, 3 windows in a row) does not take it for a
    straggler."""
    records = train(tmp_path, RUN + ["parallelism=dp4tp1pp1", "tokens.train_steps=30", "health.every=5"])
    assert findings(records, "straggler") == []
    assert json.load(open(tmp_path / "summary.json"))["health"]["stragglers"] == []


# -- loss spikes ---------------------------------------------------------------------------------
SPIKY = RUN + ["tokens.train_steps=10", "checkpoint.checkpoint_interval=4", "health.spike.window=4",
               "fault_injection.spike_at_step=7"]


def resumed_from_checkpoint_4(run, folder, overrides: list[str]) -> dict[int, float]:
    """A copy of `run`'s checkpoint 4 and skipped_batches.json in a new run folder, resumed to the end with the
    spiking batch still planted but a window of 50 steps (no spike can be judged): the record alone acts."""
    shutil.copytree(run / "checkpoints" / "4", folder / "checkpoints" / "4")
    shutil.copy(run / "checkpoints" / "skipped_batches.json", folder / "checkpoints")
    (folder / "checkpoints" / "latest.txt").write_text("4")
    records = train(folder, SPIKY + overrides + ["health.spike.window=50"])
    assert findings(records, "spike") == []
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@SLOW
def test_a_spike_warned_about_is_trained_through(tmp_path):
    records = train(tmp_path, RUN + ["tokens.train_steps=8", "health.spike.window=4",
                                     "fault_injection.spike_at_step=7"])
    spike, = findings(records, "spike")
    assert spike["step"] == 7 and spike["health/action"] == "warn" and spike["health/deviations"] > 6
    assert [r["skipped_steps"] for r in records if "loss" in r] == [0] * 8


@SLOW
def test_a_skipped_spike_is_skipped_again_by_a_resume(tmp_path):
    records = train(tmp_path / "run", SPIKY + ["health.spike.action=skip"])
    spike, = findings(records, "spike")
    assert (spike["step"], spike["health/first_sample"]) == (7, 48)   # global batch 8: samples 48-55
    steps = {r["step"]: r for r in records if "loss" in r}
    assert [steps[s]["skipped_steps"] for s in range(1, 11)] == [0] * 6 + [1] * 4
    resumed = resumed_from_checkpoint_4(tmp_path / "run", tmp_path / "resumed", ["health.spike.action=skip"])
    assert [resumed[s] for s in range(5, 11)] == [steps[s]["loss"] for s in range(5, 11)]


@SLOW
def test_a_rollback_returns_to_the_checkpoint_and_a_resume_follows_it(tmp_path):
    """The spike at step 7 rolls every rank back to checkpoint 4; steps 5 and 6 retrain the same batches to the
    same losses, step 7 reads past the spiking batch. A resume from checkpoint 4 trains the same steps."""
    records = train(tmp_path / "run", SPIKY + ["health.spike.action=rollback", "parallelism=dp2tp1pp1"])
    spike, = findings(records, "spike")
    assert spike["step"] == 7 and spike["health/action"] == "rollback"
    losses = [(r["step"], r["loss"]) for r in records if "loss" in r]
    assert [step for step, _ in losses] == [1, 2, 3, 4, 5, 6, 7, 5, 6, 7, 8, 9, 10]
    assert losses[4:6] == losses[7:9] and losses[6][1] > 10 > losses[9][1]
    saved = json.load(open(tmp_path / "run" / "checkpoints" / "skipped_batches.json"))["batches"]
    assert [(b["step"], b["first_sample"], b["samples"], b["action"]) for b in saved] == [(7, 48, 8, "rollback")]
    resumed = resumed_from_checkpoint_4(tmp_path / "run", tmp_path / "resumed",
                                        ["health.spike.action=rollback", "parallelism=dp2tp1pp1"])
    assert [resumed[s] for s in range(5, 11)] == [loss for _, loss in losses[7:]]


@SLOW
def test_rollbacks_stop_after_max_rollbacks(tmp_path):
    """A run that rolled back once already (its record says so) stops at the next spike with max_rollbacks=1."""
    (tmp_path / "checkpoints").mkdir()
    earlier = {"step": 90, "first_sample": 720, "samples": 8, "loss": 9.0, "median": 3.0, "action": "rollback"}
    (tmp_path / "checkpoints" / "skipped_batches.json").write_text(json.dumps({"batches": [earlier]}))
    with pytest.raises(KnownFailure, match="step 7: loss spike: .*max_rollbacks=1 rollbacks done already"):
        train(tmp_path, SPIKY + ["health.spike.action=rollback", "health.spike.max_rollbacks=1"])


# -- replay checks -------------------------------------------------------------------------------
LAYOUTS = {"one": [], "dp2": ["parallelism=dp2tp1pp1"], "tp2": ["parallelism=dp1tp2pp1"],
           "pp2": ["parallelism=dp1tp1pp2"], "zero3": ["parallelism=dp2tp1pp1", "optimizer.zero_stage=3"]}


@pytest.mark.parametrize("layout", tiered(LAYOUTS, quick=["one"]))
def test_replays_find_nothing_and_train_exactly_as_without(layout, train_once, tmp_path):
    """Every step replayed: no finding, and the losses are those of the run without replays to the bit (the
    first pass's gradients are dropped, not added: ZeRO-3's reduce-scatters included)."""
    run = RUN + ["tokens.train_steps=3"] + LAYOUTS[layout]
    records = train(tmp_path, run + ["health.replay_every=1"])
    assert findings(records, "replay") == []
    assert train_losses(records) == train_losses(train_once(run)[1])


@pytest.mark.parametrize("layout", tiered(LAYOUTS, quick=["one"]))
def test_a_flipped_gradient_bit_is_found_with_its_rank_and_parameter(layout, tmp_path):
    """The last rank flips bit 20 of its first parameter's gradient once at step 2 (in the first of the two
    passes): that rank and that parameter are named, nothing else."""
    rank = 0 if layout == "one" else 1
    records = train(tmp_path, RUN + ["tokens.train_steps=3", "health.replay_every=1", "health.replay_action=skip",
                                     f"fault_injection.flip_gradient_rank={rank}"] + LAYOUTS[layout])
    found, = findings(records, "replay")
    first_parameter = "model.layers.2.input_layernorm.weight" if layout == "pp2" else "model.embed_tokens.weight"
    assert (found["step"], found["health/rank"], found["health/parameter"]) == (2, rank, first_parameter)
    assert found["health/parameters"] == 1
    assert [r["skipped_steps"] for r in records if "loss" in r] == [0, 1, 1]


@SLOW
def test_a_replay_mismatch_stops_the_run_naming_rank_and_parameter(tmp_path):
    with pytest.raises(WorkerFailed, match="rank 1 on .* computed another gradient for model.embed_tokens.weight"):
        train(tmp_path, RUN + ["tokens.train_steps=3", "health.replay_every=2", "parallelism=dp2tp1pp1",
                               "fault_injection.flip_gradient_rank=1"])
