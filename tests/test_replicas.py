"""Replica groups (fault_tolerance=torchft), the parts that need no second group: the config (the default changes
nothing, the global batch is shared), every bad input refused in one line naming the key, a rank's state as
safetensors and its transport to a healing peer. Runs of several groups: tests/test_replica_groups.py."""
import importlib.util
import socket
from datetime import timedelta
from unittest import mock

import pytest
import torch

from nanoexp.config import batch_accumulation, global_batch_size, replica_groups
from nanoexp.parallel.replicas import StateTransport, from_safetensors, to_safetensors
from tests.helpers import compose_config, require
from tests.test_bad_inputs import run_cli

FT = "fault_tolerance."


def test_the_default_changes_nothing():
    cfg = compose_config(["parallelism=dp2tp1pp1"])
    assert cfg.fault_tolerance.method == "none" and replica_groups(cfg) == 1
    assert (global_batch_size(cfg), batch_accumulation(cfg)) == (32, 4)


def test_the_global_batch_is_shared_by_the_groups():
    """tokens.global_batch_size is the batch of all groups: R groups of dp ranks each accumulate 1/R of it."""
    cfg = compose_config(["parallelism=dp2tp1pp1", "fault_tolerance=torchft", FT + "replica_groups=4"])
    assert replica_groups(cfg) == 4 and (global_batch_size(cfg), batch_accumulation(cfg)) == (32, 1)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TORCHFT = ["fault_tolerance=torchft"]
CASES = [
    ("no groups", TORCHFT + [FT + "replica_groups=0"], "fault_tolerance.replica_groups=0"),
    ("groups do not divide the batch", TORCHFT + [FT + "replica_groups=3"],
     "fault_tolerance.replica_groups=3 does not divide the global batch"),
    ("more replicas needed than groups", TORCHFT + [FT + "min_replicas=3"], "fault_tolerance.min_replicas=3"),
    ("group beyond the groups", TORCHFT + [FT + "group=2", FT + "lighthouse=http://localhost:1"],
     "fault_tolerance.group=2"),
    ("group without a lighthouse", TORCHFT + [FT + "group=1"], "fault_tolerance.lighthouse=http://host:port"),
    ("lighthouse not an address", TORCHFT + [FT + "lighthouse=lighthouse"], "fault_tolerance.lighthouse=lighthouse"),
    ("unknown method", [FT + "method=raft"], "fault_tolerance.method=raft"),
    ("unknown semi-sync", TORCHFT + [FT + "semi_sync=local_sgd"], "fault_tolerance.semi_sync=local_sgd"),
    ("groups without torchft", [FT + "replica_groups=2"], "fault_tolerance.replica_groups=2 has no effect"),
    ("muon across groups", TORCHFT + ["optimizer.optimizer_factory.name=muon"], "optimizer.optimizer_factory.name"),
    ("routing bias across groups", TORCHFT + ["model=moe_tiny", "model.moe.balance=bias", "model.moe.aux_loss_coef=0"],
     "model.moe.balance=bias"),
    ("diloco over shards", TORCHFT + [FT + "semi_sync=diloco", "optimizer.zero_stage=1", "parallelism=dp2tp1pp1"],
     "fault_tolerance.semi_sync=diloco"),
    ("kill without groups", ["fault_injection.kill_group=0"], "fault_injection.kill_group=0"),
    ("rollback across groups", TORCHFT + ["health.spike.action=rollback", "checkpoint.checkpoint_interval=10"],
     "health.spike.action=rollback"),
    ("restarts of a group started elsewhere", TORCHFT + [FT + "group=0", FT + "lighthouse=http://localhost:1",
                                                         FT + "max_restarts=5"], "fault_tolerance.max_restarts=5"),
    ("group under torchrun without its number", TORCHFT, "fault_tolerance.group=null under torchrun"),
]


@pytest.mark.parametrize("name, overrides, needle", CASES, ids=[case[0] for case in CASES])
def test_bad_input_is_refused_in_one_line(name, overrides, needle, tmp_path, capsys):
    env = {"RANK": "0", "WORLD_SIZE": "1"} if "torchrun" in name else {}
    code = run_cli(overrides, env, tmp_path / "run")
    err = capsys.readouterr().err
    assert code == 2 and needle in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_torchft_missing_is_refused(tmp_path, capsys):
    found = importlib.util.find_spec
    with mock.patch("importlib.util.find_spec", lambda name, *a: None if name == "torchft" else found(name, *a)):
        code = run_cli(TORCHFT, {}, tmp_path / "run")
    err = capsys.readouterr().err
    assert code == 2 and "pip install -e '.[ft]'" in err and len(err.strip().splitlines()) == 1, err


def test_a_lighthouse_out_of_reach_is_named(tmp_path, capsys):
    require("torchft")
    address = f"http://localhost:{closed_port()}"
    code = run_cli(TORCHFT + [FT + "group=0", f"{FT}lighthouse={address}", FT + "quorum_timeout_s=0.5"], {},
                   tmp_path / "run")
    err = capsys.readouterr().err
    assert code == 2 and f"fault_tolerance.lighthouse={address}: cannot be reached within" in err, err
    assert len(err.strip().splitlines()) == 1


def test_a_state_travels_as_safetensors():
    """Tensors (0-d ones too), numbers, strings, nested and empty dicts come back as they went; nothing pickled."""
    state = {"parameters": {"0": torch.randn(3, 4), "1": torch.arange(5)}, "shards": {},
             "optimizer": {"0": {"step": torch.tensor(7.0), "exp_avg": torch.ones(2), "betas": [0.9, 0.95]}},
             "progress": {"consumed_samples": 128, "stage_consumed_samples": {"anneal": 64}, "name": None}}
    back = from_safetensors(to_safetensors(state))
    assert back["shards"] == {} and back["progress"] == state["progress"]
    assert back["optimizer"]["0"]["betas"] == [0.9, 0.95]
    for got, want in [(back["parameters"]["0"], state["parameters"]["0"]), (back["parameters"]["1"],
                      state["parameters"]["1"]), (back["optimizer"]["0"]["step"], state["optimizer"]["0"]["step"])]:
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_the_transport_serves_the_state_of_its_step():
    server, client = StateTransport(timeout_s=5), StateTransport(timeout_s=5)
    try:
        server.send_checkpoint([1], 12, {"w": torch.full((2, 2), 3.0), "step": 12}, timedelta(seconds=5))
        got = client.recv_checkpoint(0, server.metadata(), 12, timedelta(seconds=5))
        assert torch.equal(got["w"], torch.full((2, 2), 3.0)) and got["step"] == 12
        with pytest.raises(Exception, match="404"):   # another step than the one served
            client.recv_checkpoint(0, server.metadata(), 11, timedelta(seconds=5))
    finally:
        server.shutdown()
        client.shutdown()


class FakeGroups:
    """Stands for the other live groups, with `others` real target tokens each."""
    every_step = True

    def __init__(self, others: list[int]):
        self.others, self.live = others, 1 + len(others)

    def sum(self, tensors):
        for tensor in tensors:
            tensor.add_(sum(self.others))


@pytest.mark.parametrize("others", [[], [3], [5, 8]])
def test_the_loss_is_the_mean_over_the_live_groups_tokens(others):
    """StepRunner.loss_denominator with live groups of `others` tokens besides this one's 5: every group divides
    its token-loss sum by (the live groups' tokens / (dp x cp x live groups)), so that the average over the live
    groups (parallel/replicas.py) of their losses is the mean over every token they trained, however many each had."""
    from types import SimpleNamespace

    from nanoexp.runtime.step import StepRunner
    runner = StepRunner.__new__(StepRunner)
    runner.ctx = SimpleNamespace(is_last_stage=True, dp_cp=1, device=torch.device("cpu"),
                                 replica_groups=FakeGroups(others))
    labels = torch.tensor([[1, 2, -100, 3], [4, -100, -100, 5]])   # 5 real targets (IGNORE_INDEX is -100)
    denominator = runner.loss_denominator([{"labels": labels}])
    tokens = [5, *others]
    sums = [2.0 * n + 1 for n in tokens]   # each group's token-loss sum
    averaged = sum(total / denominator for total in sums) / len(tokens)
    assert float(averaged) == pytest.approx(sum(sums) / sum(tokens), rel=1e-6)
