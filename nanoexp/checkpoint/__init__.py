"""Checkpoints: sharded atomic save (save.py), in the background (async_save.py), load on any layout (load.py), and
the trainer's interface (manager.py)."""
from nanoexp.checkpoint.load import CheckpointReader
from nanoexp.checkpoint.manager import CheckpointManager, Progress, Resume, latest_checkpoint
from nanoexp.checkpoint.save import CheckpointError
