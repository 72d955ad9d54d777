"""A layer's saved activations in host memory between its forward and its backward (parallelism.offload_activations,
runtime/recompute.py): each tensor autograd saves inside the layer is copied out as it is saved, and the first one
the layer's backward asks for brings back all of that layer's and starts on the layer before it, whose copy then
overlaps this backward. On CUDA the copies run on a stream of their own into pinned memory; on a CPU (the tests:
the mechanism without the streams) they are plain copies. The bytes come back as they left: gradients are exact."""
from __future__ import annotations

import weakref

import torch


class _Group:
    """What one forward call of a layer saved (weak references: autograd owns the saved tensors)."""

    def __init__(self, layer: int, before: "_Group | None"):
        self.layer, self.members = layer, []
        # the call just before, if it ran the layer before this one (in backward it comes next)
        self.before = weakref.ref(before) if before is not None and before.layer == layer - 1 else None


class _Saved:
    """One saved tensor: on the host until its group is fetched, then on the device."""
    __slots__ = ("group", "host", "device", "__weakref__")

    def __init__(self, group: _Group, host: torch.Tensor):
        self.group, self.host, self.device = group, host, None


class ActivationOffload:
    """Saved-tensor hooks around each layer's forward (`saving(n)`); tensors of parameters stay where they are."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.last: _Group | None = None

    def saving(self, n: int):
        group = self.last = _Group(n, self.last)
        return torch.autograd.graph.saved_tensors_hooks(lambda tensor: self.pack(group, tensor), self.unpack)

    def pack(self, group: _Group, tensor: torch.Tensor):
        if tensor.device != self.device or isinstance(tensor, torch.nn.Parameter) or isinstance(
                tensor._base, torch.nn.Parameter):
            return tensor
        saved = _Saved(group, self.copy(tensor, torch.device("cpu")))
        group.members.append(weakref.ref(saved))
        return saved

    def unpack(self, saved):
        if isinstance(saved, torch.Tensor):
            return saved
        if saved.device is None:
            self.fetch(saved.group)
            before = saved.group.before() if saved.group.before is not None else None
            if before is not None:
                self.fetch(before)
        if self.stream is not None:   # the copy is queued on the offload stream: the compute stream waits for it
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.stream)
            saved.device.record_stream(current)
        return saved.device

    def fetch(self, group: _Group) -> None:
        for member in group.members:
            saved = member()
            if saved is not None and saved.device is None:
                saved.device, saved.host = self.copy(saved.host, self.device), None

    def copy(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """`tensor` on `device` with its strides (where they are dense: the backward's kernels see the same layout),
        copied on the offload stream after what the compute stream queued (CUDA; pinned on the host)."""
        layout = torch.empty_like(tensor, device="meta")   # empty_like's strides, nothing allocated
        if self.stream is None:
            return torch.empty_strided(layout.shape, layout.stride(), dtype=tensor.dtype, device=device).copy_(tensor)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):   # a device copy belongs to this stream until unpack hands it over
            out = torch.empty_strided(layout.shape, layout.stride(), dtype=tensor.dtype, device=device,
                                      pin_memory=device.type == "cpu")
            out.copy_(tensor, non_blocking=True)
        if tensor.is_cuda:
            tensor.record_stream(self.stream)   # its memory is not reused before the copy has read it
        return out
