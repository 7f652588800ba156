"""Which device a peer trains on, and how: automatic choice, bf16 autocast where the GPU has it,
and a description of the device and its memory for records, `shoal check` and logs."""

import contextlib
import functools
import os
import resource
import sys
from collections.abc import Callable
from pathlib import Path

import torch


class DeviceError(ValueError):
    """The requested device is not available here."""


def choose_device(setting: str = "auto") -> torch.device:
    """`auto`: the first CUDA GPU, else Apple's MPS, else the CPU. An explicit device is checked."""
    if setting == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", 0)
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(setting)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(
                f"--device {setting}: this torch build sees no CUDA GPU (torch {torch.__version__})"
            )
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise DeviceError(f"--device {setting}: only {torch.cuda.device_count()} CUDA GPUs here")
        return torch.device("cuda", index)
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceError(f"--device {setting}: MPS is not available on this machine")
    return device


def autocast_for(
    device: torch.device, precision: str = "auto"
) -> Callable[[], contextlib.AbstractContextManager]:
    """`--precision`: auto, bf16 autocast on CUDA GPUs that support bf16 and fp32 elsewhere; fp32; bf16
    autocast on any device (ValueError naming the flag on a GPU without bf16); or fp16 autocast, whose
    gradients the trainer scales (`LossScale`: unscaled they underflow, and DeMo's sign and DiLoCo's
    pseudo-gradient would carry the zeros)."""
    bf16 = functools.partial(torch.autocast, device_type=device.type, dtype=torch.bfloat16)
    if precision == "fp32":
        return contextlib.nullcontext
    if precision == "fp16":
        return functools.partial(torch.autocast, device_type=device.type, dtype=torch.float16)
    if precision == "bf16":
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError(f"--precision bf16: {torch.cuda.get_device_name(device)} has no bf16; use fp32")
        return bf16
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return bf16
    return contextlib.nullcontext


def describe(device: torch.device) -> dict[str, object]:
    """Name, total and free memory (bytes) of the device; the CPU's from the OS."""
    total: int | None
    free: int | None
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        name = torch.cuda.get_device_name(device)
        return {"device": str(device), "name": name, "memory_total": total, "memory_free": free}
    total = free = None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    name = "Apple GPU (MPS)" if device.type == "mps" else f"CPU, {os.cpu_count()} cores"
    return {"device": str(device), "name": name, "memory_total": total, "memory_free": free}


def memory_in_use(device: torch.device) -> Callable[[], float]:
    """A reading of the memory training uses on `device`, in bytes: tensors allocated on a CUDA GPU or
    MPS (a counter read, no synchronization), the process's resident set on the CPU."""
    if device.type == "cuda":
        return lambda: float(torch.cuda.memory_allocated(device))
    if device.type == "mps":
        return lambda: float(torch.mps.current_allocated_memory())
    return resident_bytes


def resident_bytes() -> float:
    """This process's resident set size (Linux /proc), else its peak (getrusage)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return float(pages * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return float(peak if sys.platform == "darwin" else peak * 1024)


class LossScale:
    """Dynamic loss scaling for fp16 autocast (`--precision fp16`): the loss is multiplied by `scale`
    (a power of two) before its backward pass, so that small gradients do not underflow in fp16, and
    the gradients divided by it before the optimizer's step. A step whose gradients overflowed has them
    zeroed (the optimizer still steps, so that the swarm's round goes on; counted in `skipped`) and
    halves the scale; `growth_every` steps without overflow double it. One host sync a step.
    """

    def __init__(self, *, scale: float = 2.0**16, growth_every: int = 2000):
        self.scale, self.growth_every = scale, growth_every
        self.good_steps = 0
        self.skipped = 0
        """Steps whose gradients overflowed (zeroed, the scale halved)."""

    def unscale(self, params: list[torch.Tensor]) -> bool:
        """Divides the gradients by the scale; False (and zeroed) if any was not finite."""
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return True
        found = torch.zeros(1, device=grads[0].device)
        inverse = torch.full((1,), 1.0 / self.scale, device=grads[0].device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inverse)
        if found.item():  # the one sync: whether this step's gradients may be used
            for grad in grads:
                grad.zero_()
            self.scale, self.good_steps, self.skipped = max(self.scale / 2, 1.0), 0, self.skipped + 1
            return False
        self.good_steps += 1
        if self.good_steps % self.growth_every == 0:
            self.scale = min(self.scale * 2, 2.0**24)
        return True
