"""When a step's work is done. CUDA runs kernels after the host queued them: a timer read on the host right after
`optimizer.step()` stops before the optimizer's kernels (and ZeRO's parameter all-gathers) have run, which then
finish inside the next step's first host read, outside every step's window, and tokens/s and MFU read high. A
step's window therefore ends at a device synchronisation; on CPU the work is done when the call returns."""
from __future__ import annotations

import torch


def synchronize(device: torch.device) -> None:
    """Wait until `device` has finished everything queued on it (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
