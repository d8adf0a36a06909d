import pytest
import torch

from flashmemory.dump.backend import DumpItemError
from flashmemory.dump.protocol import DumpProtocolError, DumpRequest
from flashmemory.dump.sglang_backend import merge_passes
from flashmemory.labels.golden import golden_labels
from flashmemory.sglang.dump_mode import DumpRecorder, parse_request

pytestmark = pytest.mark.sglang


def test_request_parsing_uses_the_shared_protocol(tmp_path):
    assert parse_request({"other": 1}) is None and parse_request(None) is None
    want = DumpRequest(pass_=1, doc_index=3, output_dir=str(tmp_path), target_csa_layers=(10, 12))
    assert parse_request(want.to_custom_params()) == want
    for bad, msg in [({"pass": 1, "doc_index": 0, "output_dir": "rel/dir"}, "absolute"),
                     ({"pass": 1, "doc_index": 0, "output_dir": "/x", "topp": "hi"}, "bad field"),
                     ({"pass": 3, "doc_index": 0, "output_dir": "/x"}, "pass=3"),
                     ({"output_dir": "/x"}, "missing"),
                     ({"pass": 1, "doc_index": 0, "output_dir": "/x", "target_csa_layers": [30]}, "outside")]:
        with pytest.raises(DumpProtocolError, match=msg) as e:
            parse_request({"flashmemory_dump": bad}, rid="r7")
        assert "r7" in str(e.value)


def _run_request(rec, rid, req, prompt, steps, kv, per_layer=None, seed=0, n_layers=3):
    """Feed the recorder what the indexer hook would for one request: every c4 layer, every decode step."""
    g = torch.Generator().manual_seed(seed)
    rec.admit(rid, req.to_custom_params())
    for t in range(steps):
        rec.begin_step([rid])
        pos = prompt + t
        n = (pos + 1) // 4
        for L in range(n_layers):
            lg = torch.randn(1, 32, generator=g)
            lg[:, n:] = float("-inf")
            if per_layer is not None:
                per_layer[L].append(lg[0])
            rec.observe_layer(L, [rid], lg, torch.tensor([n]), torch.tensor([pos]), hidden=torch.randn(1, 8, generator=g),
                              new_chunks=lambda b, s, e: kv[s:e])
    rec.begin_step([])                                                  # request gone: finalized


def test_recorder_files_go_through_the_client_merge(tmp_path):
    """Pass 1 (generation) and pass 2 (prompt + response, 2 tokens) as the client asks for them; the server's
    files merge into one committed-ready document with pass 2's keys and pass 1's labels."""
    staging = tmp_path / ".staging"
    kw = dict(doc_index=4, output_dir=str(staging), topp=0.5, min_layers=2, target_csa_layers=(1, 2))
    r1, r2 = DumpRequest(pass_=1, **kw), DumpRequest(pass_=2, **kw)
    rec = DumpRecorder(index_topk=8)
    g = torch.Generator().manual_seed(1)
    kv1 = torch.randint(0, 255, (64, 132), dtype=torch.uint8, generator=g)
    kv2 = torch.randint(0, 255, (64, 132), dtype=torch.uint8, generator=g)
    prompt, steps = 40, 6
    per_layer = [[] for _ in range(3)]
    _run_request(rec, "p1", r1, prompt, steps, kv1, per_layer)
    _run_request(rec, "p2", r2, prompt + steps, 2, kv2, seed=5)        # re-prefilled prompt + response
    assert rec.written == [str(r1.doc_path()), str(r2.doc_path())]
    assert r1.doc_path() == staging / "pass1" / "doc_00004.safetensors"
    doc = merge_passes(r1, r2, rid="src:4", where="item 4")
    want = golden_labels([torch.stack(x) for x in per_layer], topk=8, topp=0.5, min_layers=2)
    assert doc.doc_index == 4 and doc.rid == "src:4" and doc.target_layers == [1, 2]
    assert torch.equal(doc.label_pointers, want.pointers) and torch.equal(doc.label_indices, want.indices)
    assert doc.n_tokens == steps and doc.n_prompt_blocks == prompt // 4
    n2 = (prompt + steps + 2) // 4                                      # pass 2 saw prompt + response chunks
    assert torch.equal(doc.compk[1], kv2[:n2]) and torch.equal(doc.compk[2], kv2[:n2])
    assert set(doc.native_logits) == {(L, t) for L in (1, 2) for t in range(3)}


def test_merge_rejects_a_short_pass2(tmp_path):
    kw = dict(doc_index=0, output_dir=str(tmp_path), target_csa_layers=(1,), min_layers=1)
    r1, r2 = DumpRequest(pass_=1, **kw), DumpRequest(pass_=2, **kw)
    rec = DumpRecorder(index_topk=8)
    kv = torch.randint(0, 255, (64, 132), dtype=torch.uint8)
    _run_request(rec, "a", r1, 40, 8, kv)
    _run_request(rec, "b", r2, 8, 1, kv)                                # far too few chunks for pass 1's steps
    with pytest.raises(DumpItemError, match="compk"):
        merge_passes(r1, r2, rid="x", where="item 0")
