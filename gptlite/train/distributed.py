"""Training in several processes under torchrun: the process group, its orderly end, and the ranks agreeing on a
problem that one of them found. A single process (no torchrun) is rank 0 of a world of 1 and starts no group.
"""

from __future__ import annotations

import contextlib
import gc
import os
import traceback
from collections.abc import Iterator

import torch
import torch.distributed as dist


@contextlib.contextmanager
def processes() -> Iterator[tuple[int, int, int]]:
    """(rank, local_rank, world_size): starts the process group when launched by torchrun (nccl with CUDA, gloo
    otherwise); on the way out, also on errors, ends it after everything that uses it.

    The order matters at exit: a DDP reducer or an FSDP module freed after the process group (its last
    reference gone, or collected later from a reference cycle) made gloo's destructor join its worker threads
    while holding the GIL, a hang in about one run in ten, or an abort ("terminate called without an active
    exception"). So the frames of an error's traceback, which keep the run's model alive, are cleared, and
    everything collected, before the group ends."""
    if "RANK" not in os.environ:
        rank, local_rank, world_size = 0, 0, 1
    else:
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
        rank = dist.get_rank()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        world_size = dist.get_world_size()
    try:
        yield rank, local_rank, world_size
    except BaseException as e:
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


def stop_together(problem: str | None, world_size: int) -> None:
    """Raise ValueError(problem) on every rank when rank 0 found one, so that no rank waits in a collective for a
    rank that stopped."""
    if world_size > 1:
        box = [problem]
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
    if problem:
        raise ValueError(problem)
