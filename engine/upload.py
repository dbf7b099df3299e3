"""Weights copied from the file's memory map to a GPU through two reused pinned staging buffers.

Copying a tensor out of the map into fresh host memory and then to the GPU runs at the speed of
the fresh pages' faults (~2-4 GB/s on the development VM); a staging buffer that is reused reads the
map at the memory's speed (16 GB/s there, two threads), and with two of them the copy of one chunk
over the bus overlaps the read of the next.
"""

from __future__ import annotations

import torch

CHUNK = 64 << 20  # bytes per staging buffer


class Uploader:
    """Copies host tensors (a weight's bytes in the file map) onto a device, `chunk` bytes at a time
    through two staging buffers, pinned when the destination is a GPU. The buffers are made on first
    use and dropped by `close` (a later upload makes them again)."""

    def __init__(self, chunk: int = CHUNK):
        self.chunk = chunk
        self._stages: list[torch.Tensor] = []
        self._copied: list[torch.cuda.Event | None] = [None, None]  # each buffer's last copy out of it
        self._turn = 0

    def to(self, src: torch.Tensor, device: torch.device) -> torch.Tensor:
        """`src` (contiguous) copied onto `device`, same shape and dtype. Returns before the last chunk's
        copy has finished on a GPU: work queued after it on the device's current stream sees the bytes."""
        dst = torch.empty(src.shape, dtype=src.dtype, device=device)
        source, target = src.reshape(-1).view(torch.uint8), dst.view(-1).view(torch.uint8)
        for start in range(0, source.numel(), self.chunk):
            n = min(self.chunk, source.numel() - start)
            stage = self._stage(device)
            stage[:n].copy_(source[start:start + n])
            target[start:start + n].copy_(stage[:n], non_blocking=True)
            if device.type == "cuda":
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                self._copied[self._turn] = event
            self._turn ^= 1
        return dst

    def _stage(self, device: torch.device) -> torch.Tensor:
        """The buffer whose turn it is, once its previous copy to the device has left it."""
        if not self._stages:
            pinned = device.type == "cuda"
            self._stages = [torch.empty(self.chunk, dtype=torch.uint8, pin_memory=pinned) for _ in range(2)]
        event = self._copied[self._turn]
        if event is not None:
            event.synchronize()
        return self._stages[self._turn]

    def close(self) -> None:
        """Waits for the copies in flight and drops the buffers."""
        for event in self._copied:
            if event is not None:
                event.synchronize()
        self._stages, self._copied = [], [None, None]
