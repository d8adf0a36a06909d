import pytest
import torch

from flashmemory.dump.format import load_doc, read_metadata
from flashmemory.labels.golden import golden_labels
from flashmemory.sglang.dump_mode import DumpRecorder, DumpRequest, DumpRequestError

pytestmark = pytest.mark.sglang


def test_request_parsing(tmp_path):
    assert DumpRequest.from_custom_params({"other": 1}) is None
    r = DumpRequest.from_custom_params({"flashmemory_dump": {"output_dir": str(tmp_path), "target_csa_layers": [12, 10]}})
    assert r.target_csa_layers == (10, 12) and r.topp == 0.6
    for bad, msg in [({"output_dir": "rel/dir"}, "absolute"), ({"output_dir": "/x", "topp": "hi"}, "numbers"),
                     ({"output_dir": "/x", "target_csa_layers": [30]}, "outside"), ({"output_dir": "/x", "oops": 1}, "oops")]:
        with pytest.raises(DumpRequestError, match=msg):
            DumpRequest.from_custom_params({"flashmemory_dump": bad}, rid="r7")


def test_recorder_writes_golden_labels(tmp_path):
    rec = DumpRecorder(index_topk=8)
    rec.admit("a", {"flashmemory_dump": {"output_dir": str(tmp_path), "topp": 0.5, "min_layers": 2,
                                         "target_csa_layers": "1"}})
    g = torch.Generator().manual_seed(0)
    n_layers, steps, prompt = 3, 4, 40
    kv = torch.randint(0, 255, (64, 132), dtype=torch.uint8, generator=g)
    per_layer = [[] for _ in range(n_layers)]
    for t in range(steps):
        rec.begin_step(["a"])
        pos = prompt + t
        n = (pos + 1) // 4
        for L in range(n_layers):
            lg = torch.randn(1, 16, generator=g)
            lg[:, n:] = float("-inf")
            per_layer[L].append(lg[0])
            rec.observe_layer(L, ["a"], lg, torch.tensor([n]), torch.tensor([pos]), hidden=torch.randn(1, 8),
                              new_chunks=lambda b, s, e: kv[s:e])
    rec.begin_step([])                                               # request gone: finalized
    meta = read_metadata(tmp_path)
    assert len(meta) == 1 and meta[0]["n_decode_tokens"] == steps
    doc = load_doc(tmp_path / meta[0]["filename"])
    want = golden_labels([torch.stack(x) for x in per_layer], topk=8, topp=0.5, min_layers=2)
    assert torch.equal(doc.label_pointers, want.pointers) and torch.equal(doc.label_indices, want.indices)
    assert doc.n_prompt_blocks == prompt // 4 and doc.compk[1].shape == ((prompt + steps) // 4, 132)
    assert torch.equal(doc.compk[1], kv[: doc.compk[1].shape[0]])
