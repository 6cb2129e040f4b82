"""Wall-clock time at phase boundaries, for the decoder's and the trainer's per-phase figures. Knows nothing else."""

from time import perf_counter

import torch


def synced_clock(device: torch.device) -> float:
    # CUDA kernels are asynchronous: wait for the device's queued work, so that a phase's time is its own
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return perf_counter()
