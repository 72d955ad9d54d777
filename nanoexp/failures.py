"""Failures whose message names their cause, reported in one line without a traceback (a traceback is for bugs).

A checkpoint that cannot be written or read (a full disk, a CRC mismatch, an unreadable or reshaped shard), a
non-finite loss, a full disk anywhere, a lost or failed rank, a downstream task that stops the run: the run ends
with `nanoexp: rank R failed: <Type>: <message>` (exit 1), on one process as on many; HYDRA_FULL_ERROR=1 shows the
traceback all the same. The command-line tools end the same way (`run_tool`): a bad input in one line, exit 2.
"""
from __future__ import annotations

import errno
import sys
from collections.abc import Callable

from nanoexp.config import ConfigError


class KnownFailure(RuntimeError):
    """A runtime failure whose message says what went wrong and what to do."""


def is_known(error: BaseException) -> bool:
    return (isinstance(error, (KnownFailure, FloatingPointError))   # FloatingPointError: the trainer's non-finite loss
            or (isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)))


def run_tool(prog: str, body: Callable[[], object]) -> int:
    """A command-line tool's body, ended as train.py ends a run: a bad input (a ConfigError naming the file or
    option) as `prog: <message>`, exit 2; a runtime failure that names its cause (`is_known`: a corrupt shard, a
    full disk) as `prog: <Type>: <message>`, exit 1; anything else is a bug and keeps its traceback."""
    try:
        body()
    except ConfigError as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return 2
    except Exception as error:
        if not is_known(error):
            raise
        print(f"{prog}: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    return 0
