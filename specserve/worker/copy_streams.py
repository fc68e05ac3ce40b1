"""The step's one upload and one download, each on a side stream of its own.

On the compute stream a step's host-to-device upload would wait behind the previous step's
device-to-host copy and its kernels, and each copy costs the compute stream the copy engine's
start-up (H100, gpt-oss-20b batch 1: ~7 us of idle device before the upload, ~3 us around
the download; RESULTS.md session 16). On side streams the upload runs while the previous
step computes, and the compute stream goes on to the next step while the download runs; the
compute stream waits only for the upload (done by then) and never for the download.
"""

from __future__ import annotations

import functools

import torch

# False: both copies on the compute stream (the A/B switch of benchmarks/timeline_sweep.py).
SIDE_STREAMS = True


@functools.cache
def _streams(index: int) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """(upload, download) side streams of device `index`."""
    return torch.cuda.Stream(index), torch.cuda.Stream(index)


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (CPU) on `device`, usable on the current stream: copied from pinned memory on
    the upload stream, which the current stream then waits for."""
    pinned = host.pin_memory()
    if not SIDE_STREAMS:
        return pinned.to(device, non_blocking=True)
    main = torch.cuda.current_stream(device)
    side = _streams(main.device_index)[0]
    with torch.cuda.stream(side):
        out = pinned.to(device, non_blocking=True)
    main.wait_stream(side)
    # allocated on the upload stream, used on the compute stream: not reused before that use
    out.record_stream(main)
    return out


def download(dev: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
    """(pinned host copy, event): `dev` (CUDA) copied once the current stream's work so far
    is done, on the download stream; the event completes with the copy."""
    host = torch.empty(dev.shape, dtype=dev.dtype, pin_memory=True)
    event = torch.cuda.Event()
    if not SIDE_STREAMS:
        host.copy_(dev, non_blocking=True)
        event.record()
        return host, event
    main = torch.cuda.current_stream(dev.device)
    side = _streams(main.device_index)[1]
    side.wait_stream(main)
    with torch.cuda.stream(side):
        host.copy_(dev, non_blocking=True)
        event.record(side)
    # made on the compute stream, read on the download stream: not reused before the copy
    dev.record_stream(side)
    return host, event
