"""worker/copy_streams.py: the step's upload and download on side streams stay ordered with
the compute stream's work (GPU)."""

from __future__ import annotations

import pytest
import torch

from specserve.worker import copy_streams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_download_sees_the_compute_streams_writes() -> None:
    """The download starts only after the compute stream's work queued before it: queue a
    long chain of writes, then download a slice that only the chain's last write sets."""
    x = torch.zeros(1 << 24, device="cuda")
    for _ in range(50):
        x.add_(1.0)
    x[:4] = -7.0
    host, event = copy_streams.download(x[:8])
    del x  # the download still reads its memory: record_stream keeps it from reuse
    y = torch.full((1 << 24,), 3.0, device="cuda")  # an allocation that could take it
    event.synchronize()
    assert host.is_pinned()
    assert host.tolist() == [-7.0] * 4 + [50.0] * 4
    assert y[0].item() == 3.0


def test_upload_is_visible_to_the_compute_stream() -> None:
    """Kernels queued on the compute stream after an upload read the uploaded values, also
    while that stream is still busy with earlier work and for uploads in quick succession."""
    busy = torch.zeros(1 << 24, device="cuda")
    outs = []
    for i in range(8):
        for _ in range(5):
            busy.add_(1.0)
        dev = copy_streams.upload(torch.arange(1000, dtype=torch.int64) + i, torch.device("cuda"))
        outs.append(dev * 2)
    torch.cuda.synchronize()
    for i, out in enumerate(outs):
        assert torch.equal(out.cpu(), (torch.arange(1000) + i) * 2)
