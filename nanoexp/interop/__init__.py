"""Checkpoints to and from other formats: Hugging Face (hf.py, hf_checkpoint.py), torch.distributed.checkpoint
(dcp.py), nanotron's config (nanotron.py). What every converter checks of the folder it writes is here."""
from __future__ import annotations

import os

from nanoexp.config import ConfigError


def check_output_folder(out: str, what: str) -> None:
    """`out`, where a converter writes `what`, is new or an empty folder (nothing is ever overwritten): a
    ConfigError naming it otherwise."""
    if os.path.exists(out) and not (os.path.isdir(out) and not os.listdir(out)):
        kind = "not empty" if os.path.isdir(out) else "a file"
        raise ConfigError(f"{out} is {kind}: give a new folder for {what}")
