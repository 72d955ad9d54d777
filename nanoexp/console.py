"""What a researcher reads on the console: the facts of a run at its start, one line per logged step
with progress and an ETA, the closing summary line, and the command that resumes a stopped run.

Plain lines, not a progress bar: they read the same in a terminal, in train.log and in a SLURM
log file. Only global rank 0 (and the launching process) prints them.
"""
from __future__ import annotations

import shlex
import sys
import time
from collections import deque


def duration(seconds: float) -> str:
    """2h03m, 4m05s, 12s."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class StepClock:
    """Elapsed time since training started and the ETA of the remaining steps, from the mean of the
    last `window` step times (the first steps, slower while caches warm up, soon drop out)."""

    def __init__(self, window: int = 20):
        self.start = time.perf_counter()
        self.recent: deque[float] = deque(maxlen=window)

    def record(self, step_seconds: float) -> None:
        self.recent.append(step_seconds)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def eta(self, remaining_steps: int) -> float:
        return remaining_steps * sum(self.recent) / len(self.recent) if self.recent else 0.0


def step_line(record: dict, total_steps: int, clock: StepClock) -> str:
    """`step 10/240 | loss 2.3456 | lr 0.004 | grad_norm 0.512 | 7,012 tokens/s | 312 MB | 0m07s, ETA 2m31s`."""
    step = record["step"]
    return (f"step {step}/{total_steps} | loss {record['loss']:.4f} | lr {record['lr']:.3g} | "
            f"grad_norm {record['grad_norm']:.3f} | {record['tokens_per_sec']:,.0f} tokens/s | "
            f"{record['peak_memory_mb']:,.0f} MB | {duration(clock.elapsed())}, ETA "
            f"{duration(clock.eta(total_steps - step))}")


def summary_line(summary: dict, summary_path: str) -> str:
    """One line with what a run ended with and where its summary.json is."""
    def number(key, fmt):
        value = summary.get(key)
        return format(value, fmt) if isinstance(value, (int, float)) else "-"

    mfu = summary.get("mfu")
    return (f"{summary.get('status', '?')} | {summary.get('train_steps', 0)} steps | final loss "
            f"{number('final_loss', '.4f')} | eval loss {number('eval_loss', '.4f')} | "
            f"{duration(summary.get('wall_seconds') or 0)} | {number('tokens_per_sec', ',.0f')} tokens/s | "
            f"MFU {'-' if mfu is None else f'{100 * mfu:.1f}%'} | {summary_path}")


def resume_command(overrides: list[str], run_dir: str) -> str:
    """The command line that continues a stopped run in its own folder (checkpoint.resume=auto)."""
    kept = [o for o in overrides if not o.startswith("hydra.run.dir=")]
    script = sys.argv[0] if sys.argv and sys.argv[0].endswith(".py") else "train.py"
    return shlex.join(["python", script, *kept, f"hydra.run.dir={run_dir}"])
