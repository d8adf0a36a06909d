"""End to end on the micro model: `flashmemory dump --backend hf`, then recompute everything from a capture."""

import json

import pytest
import torch

from flashmemory.dump import list_docs, load_doc, read_metadata
from flashmemory.dump.cli import main
from tests.labels.brute import brute_golden

EX = "data_generation/example_data/tiny_chat.jsonl"


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    out = tmp_path_factory.mktemp("hfdump")
    rc = main(["--backend", "hf", "--model", "micro", "--input", EX, "--output-dir", str(out), "--n-samples", "2",
               "--max-tokens", "4", "--min-layers", "2", "--no-progress"])
    assert rc == 0
    return out


def test_micro_dump_matches_brute_force(dumped):
    from flashmemory.hf import HFEngine, load_model, stored_index_keys
    eng = HFEngine(*load_model("micro", seed=0))
    meta = read_metadata(dumped)
    assert [m["item_index"] for m in meta] == [0, 1]
    for path, m in zip(list_docs(dumped), meta):
        doc = load_doc(path)
        assert doc.target_layers == [1, 2, 3] and m["target_csa_layers"] == [1, 2, 3]
        T = doc.n_tokens
        P = int(doc.positions[1][0])
        assert T == 4 and doc.input_ids.numel() == P + T and doc.n_prompt_blocks == P // 4
        assert doc.positions[2].tolist() == list(range(P, P + T))
        assert torch.equal(doc.input_ids[:P], torch.tensor(eng_prompt(eng, m, P)))
        cap = eng.forward(doc.input_ids)
        want = brute_golden([cap.index_logits[c][P:P + T] for c in range(eng.n_c4_layers)], eng.index_topk, 0.6, 2)
        assert doc.labels.to_rows() == want
        assert m["n_total_labels"] == sum(len(r) for r in want) > 0
        for L in doc.target_layers:
            torch.testing.assert_close(doc.hidden[L], cap.hidden[L][P:P + T].bfloat16().float())
            assert doc.compk[L].shape == ((P + T) // 4, eng.index_head_dim + 4)
            assert torch.equal(doc.compk[L], stored_index_keys(cap.index_keys[L]))
            for t in range(3):
                n_t = (P + t + 1) // 4
                torch.testing.assert_close(doc.native_logits[(L, t)], cap.index_logits[L][P + t, :n_t])
                assert torch.isfinite(doc.native_logits[(L, t)]).all()
        assert (doc.labels.indices.long() < doc.n_chunks_at.repeat_interleave(doc.labels.counts)).all()


def eng_prompt(eng, meta_line, P):
    from flashmemory.dump.inputs import ByteChatTokenizer, load_items
    items, _ = load_items(EX)
    ids = ByteChatTokenizer(eng.vocab_size)(items[meta_line["item_index"]].messages)
    assert len(ids) == P
    return ids


def test_rerun_is_a_no_op(dumped, capsys):
    before = (dumped / "server_metadata.jsonl").read_text()
    assert main(["--backend", "hf", "--input", EX, "--output-dir", str(dumped), "--n-samples", "2",
                 "--no-progress"]) == 0
    assert (dumped / "server_metadata.jsonl").read_text() == before
    assert "2 already done" in capsys.readouterr().out


def test_missing_layers_error(tmp_path, capsys):
    rc = main(["--backend", "hf", "--input", EX, "--output-dir", str(tmp_path), "--target-csa-layers", "10", "12",
               "20", "--no-progress"])
    assert rc == 2
    assert "4 c4 layers" in capsys.readouterr().err and not list(tmp_path.glob("doc_*"))
    json.dumps({})
