"""The fast GGUF header parser against gguf-py's reader (the reference), and the type checks."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from engine import quants
from engine.gguf_file import GGUFError, GGUFFile


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_model_q8"])
def test_header_and_tensors_match_gguf_reader(request, fixture):
    path = request.getfixturevalue(fixture)
    ours, ref = GGUFFile(path), GGUFReader(path)
    assert set(ours.metadata) == {f.name for f in ref.fields.values() if not f.name.startswith("GGUF.")}
    assert ours.metadata["tokenizer.ggml.tokens"][:50] == [str(t) for t in ref.fields["tokenizer.ggml.tokens"].contents()[:50]]
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.shape == tuple(int(n) for n in reversed(t.shape))
        assert info.qtype == t.tensor_type
        assert np.array_equal(ours.tensor_data(t.name).reshape(-1).view(np.uint8), np.asarray(t.data).reshape(-1).view(np.uint8))


def test_dequantized_tensor_matches_gguf(tiny_model_q8):
    g, ref = GGUFFile(tiny_model_q8), GGUFReader(tiny_model_q8)
    t = next(t for t in ref.tensors if t.tensor_type == GGMLQuantizationType.Q8_0)
    ours = quants.load_tensor(g, t.name, torch.float32)
    assert torch.equal(ours, torch.from_numpy(dequantize(t.data, t.tensor_type)).reshape(ours.shape))


def test_unsupported_type_is_refused_by_name(tiny_model, monkeypatch):
    monkeypatch.setattr(quants, "SUPPORTED", (GGMLQuantizationType.Q8_0,))
    with pytest.raises(GGUFError, match=r"tensor \S+ has type F32, not supported \(supported: Q8_0\)"):
        quants.check_supported(GGUFFile(tiny_model))
