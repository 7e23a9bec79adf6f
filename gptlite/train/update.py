"""The optimizer step's update, skipped when the step's loss or gradient norm is not finite, and the host's reading
of each step's figures (its loss, gradient norm, the objective's figures and the ranks' stop votes).

Two ways, chosen once for a run (`make_update`):

- `HostUpdate` reads a step's figures at once and decides on the host whether to update. Reading a figure of a GPU
  makes the host wait until the GPU has finished the step: the GPU then idles while the host loads the next batch
  and launches the next step's kernels. On a CPU nothing runs ahead of the host, so there that costs nothing.
- `DeviceUpdate`, on a GPU where every optimizer can skip its update on the device: the decision is a tensor that
  fused AdamW reads itself (its `found_inf`, the same one `torch.amp.GradScaler` hands it), the figures are copied to
  page-locked host memory without waiting, and the host reads them one step late, once the next step's work is
  queued, or at once where the loop needs them (an evaluation, a save, the last step). A stop vote or a non-finite
  step is therefore seen one step later than on the host path; the update of a non-finite step is skipped all the
  same, on the device.

GPTLITE_UPDATE=host|device forces one way (to compare them: a CPU's fused AdamW takes `found_inf` too).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Protocol

import torch


class Averages(Protocol):
    """What the update calls after each optimizer step: a weight average's update (gptlite.train.optim.WeightAverage, or
    the training state's Average or NoAverage)."""

    def update(self) -> None: ...


@dataclass
class StepRecord:
    """One optimizer step's figures as the host reads them. `finite` is False for a fault (a non-finite loss, or a
    non-finite gradient norm without float16's loss scaler, for which that is an overflow and no fault)."""

    step: int  # the step's number, counted from 1
    lr: float
    no_update: str | None  # the objective's reason to make no update, or None
    loss: float
    grad_norm: float
    figures: dict[str, float]  # the objective's, by name
    stop: bool  # a rank was asked to stop (a signal) or ran out of time
    timed_out: bool  # max_minutes ran out
    minutes: float  # wall-clock minutes since the start, as the ranks agree on them
    finite: bool


def step_stats(
    loss: torch.Tensor, grad_norm: torch.Tensor, figures: dict[str, torch.Tensor], votes: torch.Tensor
) -> torch.Tensor:
    """The step's figures as one float32 tensor on the device, to all-reduce and read at once:
    [loss, grad_norm, *figures, stop vote, time vote, minutes]."""
    return torch.cat([torch.stack([loss.float(), grad_norm.float(), *(f.float() for f in figures.values())]), votes])


def read_stats(step: int, lr: float, no_update: str | None, names: list[str], values: list[float], scaled: bool):
    """A StepRecord from the values of `step_stats` (averaged over the ranks). `scaled`: float16's loss scaler is on."""
    loss, norm, *rest = values
    *figure_values, stop_votes, time_votes, minutes = rest
    return StepRecord(
        step=step,
        lr=lr,
        no_update=no_update,
        loss=loss,
        grad_norm=norm,
        figures=dict(zip(names, figure_values, strict=True)),
        stop=stop_votes > 0,
        timed_out=time_votes > 0,
        minutes=minutes,
        finite=math.isfinite(loss) and (scaled or math.isfinite(norm)),
    )


class HostUpdate:
    """Reads the step's figures at once, then updates unless they are not finite (see the module's docstring)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer], scaler: torch.amp.GradScaler, ema: Averages | None):
        self.optimizers = optimizers
        self.scaler = scaler
        self.ema = ema
        self.pending = False  # nothing is ever left to read

    def apply(self, step: int, lr: float, no_update: str | None, names: list[str], stats: torch.Tensor):
        """Update after step `step` of `stats` (step_stats); returns [that step's StepRecord]."""
        record = read_stats(step, lr, no_update, names, stats.tolist(), self.scaler.is_enabled())
        # With float16, gradients that overflowed skip every optimizer's step (the scaler alone decides per
        # optimizer: Muon could step while AdamW skips) and scaler.update() lowers the scale; such a step is no fault.
        if record.finite and math.isfinite(record.grad_norm):
            for opt in self.optimizers:
                self.scaler.step(opt)
            if self.ema is not None:
                self.ema.update()
        self.scaler.update()
        return [record]

    def flush(self) -> list[StepRecord]:
        return []


class DeviceUpdate:
    """Updates with the decision on the device, and reads each step's figures one step late (see the module's
    docstring). Every optimizer is a fused AdamW, and no loss scaler is on (`make_update`)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer], ema: Averages | None):
        self.optimizers = optimizers
        self.ema = ema
        self.waiting: tuple | None = None  # (step, lr, no_update, names, host copy, its copy's event)

    @property
    def pending(self) -> bool:
        """Whether a step's figures are still to be read."""
        return self.waiting is not None

    def apply(self, step: int, lr: float, no_update: str | None, names: list[str], stats: torch.Tensor):
        """Update after step `step` of `stats` (step_stats) unless its loss or gradient norm is not finite, decided
        on the device; returns the StepRecord of the step before, if it was still to be read."""
        skip = (~stats[:2].isfinite().all()).float()  # (): 1.0 where the loss or the gradient norm is not finite
        for opt in self.optimizers:
            opt.found_inf = skip  # fused AdamW leaves the weights, its moments and its step count as they are
            opt.step()
            del opt.found_inf
        if self.ema is not None:  # a skipped step averages in the weights as they were
            self.ema.update()
        host = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=stats.device.type == "cuda")
        host.copy_(stats, non_blocking=True)  # queued now: it waits for this step's work only, not the next's
        event = torch.cuda.Event() if stats.device.type == "cuda" else None
        if event is not None:
            event.record()
        earlier = self.flush()
        self.waiting = (step, lr, no_update, names, host, event)
        return earlier

    def flush(self) -> list[StepRecord]:
        """The figures still to be read ([] or [one StepRecord]), waiting for their step to finish."""
        if self.waiting is None:
            return []
        step, lr, no_update, names, host, event = self.waiting
        self.waiting = None
        if event is not None:
            event.synchronize()
        return [read_stats(step, lr, no_update, names, host.tolist(), scaled=False)]


def skips_on_device(optimizers: list[torch.optim.Optimizer], scaler: torch.amp.GradScaler, device_type: str) -> bool:
    """Whether a run can skip a non-finite update on the device and read its figures late: on a GPU (where the
    device runs ahead of the host), every optimizer a fused AdamW (which takes `found_inf`; Muon does not), and no
    float16 loss scaler (which decides for itself)."""
    fused = all(isinstance(opt, torch.optim.AdamW) and opt.defaults.get("fused") for opt in optimizers)
    return device_type == "cuda" and fused and not scaler.is_enabled()


def make_update(
    optimizers: list[torch.optim.Optimizer],
    scaler: torch.amp.GradScaler,
    ema: Averages | None,
    device_type: str,
) -> HostUpdate | DeviceUpdate:
    """The run's way to update and read its figures (see the module's docstring; GPTLITE_UPDATE forces one)."""
    forced = os.environ.get("GPTLITE_UPDATE", "")
    if forced not in ("", "host", "device"):
        raise ValueError(f"GPTLITE_UPDATE={forced!r} must be host or device; unset it to choose by the device")
    if forced == "device" and not skips_on_device(optimizers, scaler, "cuda"):
        raise ValueError(
            "GPTLITE_UPDATE=device needs every optimizer to be a fused AdamW and no float16 loss scaler; unset it, "
            "or train with --optimizer=adamw and --dtype=bfloat16 or float32"
        )
    if forced == "device" or (not forced and skips_on_device(optimizers, scaler, device_type)):
        return DeviceUpdate(optimizers, ema)
    return HostUpdate(optimizers, scaler, ema)
