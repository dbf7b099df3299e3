"""Weights uploaded through the staging buffers arrive whole: every chunk in its place, for any size
and dtype, on the CPU here and on a GPU (marker `gpu`)."""

import pytest
import torch

from engine.gguf_file import GGUFFile
from engine.upload import Uploader
from engine.weights import FLOATS, WeightStore, is_vector

needs_cuda = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def tensors() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (7, 333), dtype=torch.uint8, generator=gen),  # 3 chunks, the last short
            torch.randn(5, 300, generator=gen).to(torch.float16),  # exactly 3 chunks of 1,000 bytes
            torch.randint(0, 256, (3, 4, 50), dtype=torch.uint8, generator=gen),  # less than one
            torch.empty(0, 16, dtype=torch.uint8)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_uploads_arrive_whole_through_short_chunks(device):
    up = Uploader(chunk=1000)
    for round in range(2):  # the buffers dropped by `close` are made again
        uploaded = [up.to(t, torch.device(device)) for t in tensors()]
        for src, dst in zip(tensors(), uploaded, strict=True):
            assert dst.device.type == device and dst.dtype == src.dtype and dst.shape == src.shape
            assert torch.equal(dst.cpu(), src), round
            assert dst.data_ptr() != src.data_ptr() or src.numel() == 0
        up.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_reading_the_next_chunk_waits_for_the_copy_out_of_its_buffer(device):
    up = Uploader(chunk=1 << 20)
    src = torch.arange(64 << 20, dtype=torch.int32).view(torch.uint8)  # 256 MB: copies still in flight
    assert torch.equal(up.to(src, torch.device(device)).cpu(), src)
    up.close()


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_model_q8"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_weights_on_the_gpu_are_the_files(fixture, request):
    g = GGUFFile(request.getfixturevalue(fixture))
    cuda = torch.device("cuda")
    store = WeightStore(g, cuda, torch.bfloat16)
    for name, info in g.tensors.items():
        if is_vector(info) or len(info.shape) != 2:
            continue
        lin = store.linear(name.removesuffix(".weight"), cuda)
        if info.qtype in FLOATS:  # converted to the compute dtype on the GPU
            want = torch.from_numpy(g.tensor_data(name).copy()).to(torch.bfloat16)
            assert torch.equal(lin.weight.cpu(), want), name
        else:
            assert torch.equal(lin.matrix.blocks.cpu(), torch.from_numpy(g.tensor_bytes(name).copy())), name
    store.loaded()
