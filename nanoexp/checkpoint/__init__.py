"""Checkpoints: sharded atomic save (save.py), load on any layout (load.py), the trainer's
interface (manager.py) and stop signals (signals.py)."""
from nanoexp.checkpoint.load import CheckpointReader
from nanoexp.checkpoint.manager import CheckpointManager, Progress, Resume, latest_checkpoint
from nanoexp.checkpoint.save import CheckpointError
from nanoexp.checkpoint.signals import handle_stop_signals
