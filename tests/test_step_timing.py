"""A step's time ends when the device has finished the step: the trainer synchronises the device inside the window
(on CUDA the optimizer's kernels run after optimizer.step() returns). On CPU the synchronisation is a no-op, so
the test stands in a device whose synchronisation takes 0.3 s and checks that every step's time includes it."""
import time

from nanoexp.instruments import timing
from tests.helpers import FAST, train

SLOW_SYNC_S = 0.3   # far above a FAST step on one process (tens of milliseconds), so it shows in every step's time


def test_the_step_window_ends_after_the_device_synchronisation(tmp_path, monkeypatch):
    calls = []

    def slow_synchronize(device):
        calls.append(device.type)
        time.sleep(SLOW_SYNC_S)

    monkeypatch.setattr(timing, "synchronize", slow_synchronize)
    records = train(tmp_path, FAST + ["tokens.train_steps=3", "tokens.val_check_interval=0"])
    steps = [r for r in records if "loss" in r]
    assert calls == ["cpu"] * 3   # once a step
    assert all(r["step_time_sec"] >= SLOW_SYNC_S for r in steps)
