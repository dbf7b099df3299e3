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


def split_copy(src, out_dir, max_tensors: int = 20):
    """`src` rewritten as a split GGUF (`-0000i-of-0000n.gguf`) by gguf-py's writer; returns the parts."""
    import gguf

    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(out_dir / src.name, r.get_field("general.architecture").contents(),
                        split_max_tensors=max_tensors)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        array = f.types[0] == gguf.GGUFValueType.ARRAY
        w.add_key_value(f.name, f.contents(), f.types[0], sub_type=f.types[-1] if array else None)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sorted(out_dir.glob("*-of-*.gguf"))


def test_split_gguf_loads_every_part(tiny_model_q8, tmp_path):
    import torch

    from engine.batch import Span
    from engine.loading import open_model
    from engine.runner import Runner
    from strata_desk.modelfacts import ModelFacts

    parts = split_copy(tiny_model_q8, tmp_path)
    assert len(parts) == 3
    whole, split = GGUFFile(tiny_model_q8), GGUFFile(parts[1])  # any part opens the whole model
    assert split.tensors.keys() == whole.tensors.keys()
    assert {info.part for info in split.tensors.values()} == {0, 1, 2}
    for name in whole.tensors:
        assert np.array_equal(split.tensor_bytes(name), whole.tensor_bytes(name))
    assert ModelFacts.from_gguf(parts[0]).expert_bytes == ModelFacts.from_gguf(tiny_model_q8).expert_bytes
    logits = [Runner(open_model(str(p), "cpu", context=64)[1], 0, exact=True).forward([Span(0, 0, 4)], [1, 2, 3, 4])
              for p in (tiny_model_q8, parts[0])]
    assert torch.equal(*logits)
