"""End to end on the micro model: `flashmemory dump --backend hf`, then recompute everything from a capture."""

import json

import pytest
import torch

from flashmemory.dump import list_docs, load_doc, read_metadata
from flashmemory.dump.cli import main
from tests.labels.brute import assert_rows_agree, brute_golden, brute_margins

EX = "data_generation/example_data/tiny_chat.jsonl"


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    out = tmp_path_factory.mktemp("hfdump")
    rc = main(
        [
            "--backend",
            "hf",
            "--model",
            "micro",
            "--input",
            EX,
            "--output-dir",
            str(out),
            "--n-samples",
            "2",
            "--max-tokens",
            "4",
            "--min-layers",
            "2",
            "--no-progress",
        ]
    )
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
        layers = [cap.index_logits[c][P : P + T] for c in range(eng.n_c4_layers)]
        want = brute_golden(layers, eng.index_topk, 0.6, 2)
        # The dump's label code vs the brute force: two softmax / cumsum implementations; rows differ only at near-ties.
        assert_rows_agree(doc.labels.to_rows(), want, brute_margins(layers, eng.index_topk, 0.6))
        assert m["n_total_labels"] == sum(len(r) for r in want) > 0
        for L in doc.target_layers:
            torch.testing.assert_close(doc.hidden[L], cap.hidden[L][P : P + T].bfloat16().float())
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
    assert (
        main(["--backend", "hf", "--input", EX, "--output-dir", str(dumped), "--n-samples", "2", "--no-progress"]) == 0
    )
    assert (dumped / "server_metadata.jsonl").read_text() == before
    assert "2 already done" in capsys.readouterr().out


def test_missing_layers_error(tmp_path, capsys):
    rc = main(
        [
            "--backend",
            "hf",
            "--input",
            EX,
            "--output-dir",
            str(tmp_path),
            "--target-csa-layers",
            "10",
            "12",
            "20",
            "--no-progress",
        ]
    )
    assert rc == 2
    assert "4 c4 layers" in capsys.readouterr().err and not list(tmp_path.glob("doc_*"))
    json.dumps({})


def test_micro_dump_stores_native_topk(dumped):
    """Default --store-topk cycle: step 0 of every c4 layer; doc_from_capture with `all` stores every step."""
    from flashmemory.dump.backend import DumpConfig
    from flashmemory.dump.hf_backend import doc_from_capture
    from flashmemory.hf import HFEngine, load_model

    eng = HFEngine(*load_model("micro", seed=0))
    doc = load_doc(list_docs(dumped)[0])
    P, T = int(doc.positions[1][0]), doc.n_tokens
    # Same bits as the dump's own forward (same process, model, ids, thread count), so its picks compare exactly.
    cap = eng.forward(doc.input_ids)
    assert doc.native_topk_steps.tolist() == [0] and sorted(doc.native_topk) == list(range(eng.n_c4_layers))
    for C in range(eng.n_c4_layers):
        idx, val = doc.native_topk[C]
        assert idx.shape == (1, eng.index_topk)
        row = cap.index_logits[C][P, : (P + 1) // 4].float()
        k = min(eng.index_topk, row.numel())
        want_v, want_i = torch.topk(row, k)
        assert idx[0, :k].tolist() == want_i.tolist() and (idx[0, k:] == -1).all()
        torch.testing.assert_close(val[0, :k], want_v)
    ids = doc.input_ids.tolist()
    for mode, steps in (("all", list(range(T))), ("cycle", [0, 2]), ("none", [])):
        d = doc_from_capture(
            cap,
            ids[:P],
            ids[P:],
            DumpConfig(target_layers=(1, 2, 3), store_topk=mode, topk_interval=2),
            doc_index=0,
            rid="x",
            index_topk=eng.index_topk,
            n_c4_layers=eng.n_c4_layers,
        )
        d.validate()
        assert d.native_topk_steps.tolist() == steps
        assert len(d.native_topk) == (eng.n_c4_layers if steps else 0)
        if steps:
            assert d.native_topk[2][0].shape == (len(steps), eng.index_topk)
