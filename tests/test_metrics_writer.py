"""The metric writer: W&B only when asked, and a resumed run continues the same W&B run."""
import json
import sys
import types

from nanoexp.metrics import MetricsWriter
from tests.helpers import compose_config


class FakeWandb(types.ModuleType):
    """Stands in for the wandb package (no network, no service process): records what it is given."""

    def __init__(self):
        super().__init__("wandb")
        self.inits, self.logged = [], []
        self.util = types.SimpleNamespace(generate_id=lambda: "run-abc123")

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return types.SimpleNamespace(log=lambda data, step: self.logged.append((step, data)), finish=lambda: None)


def test_wandb_resume_continues_the_same_run(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = compose_config(["logging.wandb.mode=offline", "logging.tensorboard=false"])
    for step in (1, 2):   # the first run, then a run resumed into the same folder
        writer = MetricsWriter(str(tmp_path), cfg, {})
        writer.write({"step": step, "loss": 1.0 / step})
        writer.close()
    assert [i["id"] for i in fake.inits] == ["run-abc123", "run-abc123"]
    assert all(i["resume"] == "allow" and i["mode"] == "offline" for i in fake.inits)
    assert fake.logged == [(1, {"loss": 1.0}), (2, {"loss": 0.5})]
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert lines == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}]   # appended, full precision


def test_wandb_disabled_by_default(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    MetricsWriter(str(tmp_path), compose_config(["logging.tensorboard=false"]), {}).close()
    assert fake.inits == [] and not (tmp_path / "wandb_run_id.txt").exists()
