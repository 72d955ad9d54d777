"""Failures whose message names their cause, reported in one line without a traceback (a traceback is for bugs).

A checkpoint that cannot be written or read (a full disk, a CRC mismatch, an unreadable or reshaped shard), a
non-finite loss, a full disk anywhere, a lost or failed rank, a downstream task that stops the run: the run ends
with `nanoexp: rank R failed: <Type>: <message>` (exit 1), on one process as on many; HYDRA_FULL_ERROR=1 shows the
traceback all the same.
"""
from __future__ import annotations

import errno


class KnownFailure(RuntimeError):
    """A runtime failure whose message says what went wrong and what to do."""


def is_known(error: BaseException) -> bool:
    return (isinstance(error, (KnownFailure, FloatingPointError))   # FloatingPointError: the trainer's non-finite loss
            or (isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)))

