"""Stored native top-k in dump docs: round trip, old docs, step choice, shape errors, the hf backend."""

import pytest
import torch

from flashmemory.dump import DumpFormatError, load_doc
from flashmemory.dump.backend import DumpConfig
from flashmemory.dump.format import native_topk_rows, topk_store_steps
from flashmemory.dump.writer import doc_tensors, save_doc_file

from .synth import make_doc


def add_topk(doc, steps, k=6, n_layers=4, seed=0):
    """Attach a stored top-k of `n_layers` c4 layers at `steps`, from random logits over visible chunks."""
    g = torch.Generator().manual_seed(seed)
    st = torch.tensor(steps, dtype=torch.int32)
    n_vis = doc.n_chunks_at[st.long()]
    doc.native_topk = {
        C: native_topk_rows(torch.randn(len(steps), doc.n_chunks, generator=g), n_vis, k) for C in range(n_layers)
    }
    doc.native_topk_steps = st
    return doc


def test_round_trip_of_topk_keys(tmp_path):
    doc = add_topk(make_doc(2, P=13, T=9), [0, 4, 8], k=6)  # step 0 sees 3 chunks < k: padded with -1
    tensors, _ = doc_tensors(doc)
    assert tensors["native_topk_steps"].dtype == torch.int32
    assert tensors["native_topk_idx_layer_3"].shape == (3, 6)
    assert tensors["native_topk_val_layer_3"].dtype == torch.float32
    back = load_doc(save_doc_file(tmp_path / "doc_00002.safetensors", doc))
    assert back.native_topk_steps.tolist() == [0, 4, 8] and sorted(back.native_topk) == [0, 1, 2, 3]
    for C in range(4):
        assert torch.equal(back.native_topk[C][0], doc.native_topk[C][0])
        assert torch.equal(back.native_topk[C][1], doc.native_topk[C][1])
    idx0, val0 = back.native_topk[0][0][0], back.native_topk[0][1][0]
    assert idx0.tolist()[3:] == [-1, -1, -1] and torch.isinf(val0[3:]).all() and (idx0[:3] >= 0).all()
    assert back.target_layers == [1, 3]  # stored top-k layers are not target layers


def test_old_format_doc_loads_with_empty_fields(tmp_path):
    doc = make_doc(0)
    tensors, meta = doc_tensors(doc)
    assert not any(k.startswith("native_topk") for k in tensors)
    back = load_doc(save_doc_file(tmp_path / "doc_00000.safetensors", doc))
    assert back.native_topk == {} and back.native_topk_steps.numel() == 0
    assert back.native_topk_steps.dtype == torch.int32


def test_native_topk_rows_matches_plain_topk():
    lg = torch.tensor([[0.5, 2.0, -1.0, 9.0], [3.0, float("-inf"), 1.0, 7.0]])
    idx, val = native_topk_rows(lg, torch.tensor([3, 4]), 3)
    assert idx.tolist() == [[1, 0, 2], [3, 0, 2]]
    assert val.tolist() == [[2.0, 0.5, -1.0], [7.0, 3.0, 1.0]]
    idx, val = native_topk_rows(lg, torch.tensor([1, 2]), 3)
    assert idx.tolist() == [[0, -1, -1], [0, -1, -1]] and val[0, 0] == 0.5 and torch.isinf(val[:, 1:]).all()


def test_cycle_vs_all_steps():
    assert topk_store_steps(130, "cycle", 64).tolist() == [0, 64, 128]
    assert topk_store_steps(10, "cycle", 4).tolist() == [0, 4, 8]
    assert topk_store_steps(5, "all", 64).tolist() == [0, 1, 2, 3, 4]
    assert topk_store_steps(5, "none").numel() == 0
    with pytest.raises(ValueError, match="store_topk"):
        topk_store_steps(5, "some")
    with pytest.raises(ValueError, match="topk_interval"):
        DumpConfig(topk_interval=0)
    with pytest.raises(ValueError, match="store_topk"):
        DumpConfig(store_topk="every")


def test_bad_shapes_give_clear_errors(tmp_path):
    doc = add_topk(make_doc(), [0, 4])
    doc.native_topk[2] = (doc.native_topk[2][0][:1], doc.native_topk[2][1][:1])
    with pytest.raises(DumpFormatError, match="native_topk_idx_layer_2.*S=2"):
        doc.validate()
    doc = add_topk(make_doc(), [0, 4])
    doc.native_topk[1] = (doc.native_topk[1][0], doc.native_topk[1][1][:, :3])
    with pytest.raises(DumpFormatError, match="native_topk_val_layer_1"):
        doc.validate()
    doc = add_topk(make_doc(), [0, 4])
    doc.native_topk[0] = (doc.native_topk[0][0].long(), doc.native_topk[0][1])
    with pytest.raises(DumpFormatError, match="native_topk_idx_layer_0.*int32"):
        doc.validate()
    doc = add_topk(make_doc(), [4, 0])
    with pytest.raises(DumpFormatError, match="native_topk_steps.*ascending"):
        doc.validate()
    doc = add_topk(make_doc(T=9), [0, 8])
    doc.native_topk_steps = torch.tensor([0, 9], dtype=torch.int32)  # step 9 >= T
    with pytest.raises(DumpFormatError, match="native_topk_steps"):
        doc.validate()
    doc = add_topk(make_doc(), [0])
    doc.native_topk[3][0][0, 0] = 10_000  # not visible
    with pytest.raises(DumpFormatError, match="native_topk_idx_layer_3.*visible"):
        doc.validate()
    doc = add_topk(make_doc(), [0])
    doc.native_topk[3][1][0, 0] = float("-inf")  # value invalid but id valid
    with pytest.raises(DumpFormatError, match="native_topk_idx_layer_3.*-1 with -inf"):
        doc.validate()
    doc = add_topk(make_doc(), [0])
    doc.native_topk_steps = torch.zeros(0, dtype=torch.int32)
    with pytest.raises(DumpFormatError, match="native_topk_steps.*missing or empty"):
        doc.validate()
    # On load: one half of a layer's pair missing names the missing key.
    from safetensors.torch import save_file

    tensors, meta = doc_tensors(add_topk(make_doc(), [0, 4]))
    del tensors["native_topk_val_layer_2"]
    p = tmp_path / "doc_00000.safetensors"
    save_file(tensors, str(p), metadata=meta)
    with pytest.raises(DumpFormatError, match="doc_00000.safetensors.*native_topk_val_layer_2' missing"):
        load_doc(p)
    tensors, meta = doc_tensors(add_topk(make_doc(), [0, 4]))
    del tensors["native_topk_steps"]
    save_file(tensors, str(p), metadata=meta)
    with pytest.raises(DumpFormatError, match="doc_00000.safetensors: native_topk_steps"):
        load_doc(p)
