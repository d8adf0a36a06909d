import pytest
import torch

from flashmemory.dump.backend import DumpItemError
from flashmemory.dump.format import load_doc
from flashmemory.dump.protocol import DumpProtocolError, DumpRequest
from flashmemory.dump.sglang_backend import merge_passes
from flashmemory.dump.writer import DumpWriter
from flashmemory.labels.golden import golden_labels
from flashmemory.sglang.dump.mode import DumpRecorder, parse_request

pytestmark = pytest.mark.sglang


def test_request_parsing_uses_the_shared_protocol(tmp_path):
    assert parse_request({"other": 1}) is None and parse_request(None) is None
    want = DumpRequest(pass_=1, doc_index=3, output_dir=str(tmp_path), target_csa_layers=(10, 12))
    assert parse_request(want.to_custom_params(), root=tmp_path) == want
    for bad, msg in [
        ({"pass": 1, "doc_index": 0, "output_dir": "rel/dir"}, "absolute"),
        ({"pass": 1, "doc_index": 0, "output_dir": "/x", "topp": "hi"}, "bad field"),
        ({"pass": 3, "doc_index": 0, "output_dir": "/x"}, "pass=3"),
        ({"output_dir": "/x"}, "missing"),
        ({"pass": 1, "doc_index": 0, "output_dir": str(tmp_path), "target_csa_layers": [30]}, "outside"),
    ]:
        with pytest.raises(DumpProtocolError, match=msg) as e:
            parse_request({"flashmemory_dump": bad}, rid="r7", root=tmp_path)
        assert "r7" in str(e.value)


def test_request_topk_fields_old_blocks_and_errors(tmp_path):
    old = {"version": 1, "pass": 1, "doc_index": 0, "output_dir": str(tmp_path), "target_csa_layers": [1]}
    r = parse_request({"flashmemory_dump": old}, rid="r1", root=tmp_path)
    assert (r.store_topk, r.topk_interval) == ("cycle", 64)
    r = parse_request(
        {"flashmemory_dump": {**old, "version": 2, "store_topk": "all", "topk_interval": 5}}, root=tmp_path
    )
    assert (r.store_topk, r.topk_interval) == ("all", 5)
    for field, value in [("store_topk", "x"), ("topk_interval", 0), ("version", 9)]:
        with pytest.raises(DumpProtocolError, match=rf"request r2: flashmemory_dump\.{field}={value!r}"):
            parse_request({"flashmemory_dump": {**old, "version": 2, field: value}}, rid="r2", root=tmp_path)


def test_server_writes_only_under_its_root(tmp_path):
    """Output_dir outside the operator's root, with '..', or with no root set is refused."""
    root = tmp_path / "root"
    (root / "ok").mkdir(parents=True)
    (root / "link").symlink_to(tmp_path)  # a symlink that leaves the root
    base = {"pass": 1, "doc_index": 0, "target_csa_layers": [1]}
    assert parse_request({"flashmemory_dump": {**base, "output_dir": str(root / "ok" / "new")}}, root=root)
    for od, r, msg in [
        ("/etc", root, "outside the server's dump root"),
        (str(tmp_path / "elsewhere"), root, "outside"),
        (str(root / "ok" / ".." / ".." / "x"), root, "must not contain '..'"),
        (str(root / "link" / "x"), root, "outside"),
        (str(root / "ok"), None, "no dump root"),
    ]:
        with pytest.raises(DumpProtocolError, match=msg):
            parse_request({"flashmemory_dump": {**base, "output_dir": od}}, rid="r", root=r)
    rec = DumpRecorder(index_topk=8, root=root)
    with pytest.raises(DumpProtocolError, match="outside"):
        rec.admit("r9", {"flashmemory_dump": {**base, "output_dir": "/tmp/evil"}})
    assert not rec.pending


@pytest.mark.parametrize(
    "field,value,msg",
    [
        ("target_csa_layers", "10", "must be a list|expected a list"),  # was read as layers (1, 0)
        ("target_csa_layers", [1, 1], "distinct"),
        ("target_csa_layers", [], "non-empty"),
        ("min_layers", 1000, "min_layers=1000: the model has 21 c4 layers"),
        ("min_layers", 0, "min_layers=0"),
        ("n_logit_tokens", -1, "n_logit_tokens=-1"),
        ("doc_index", "3", "doc_index='3': bad field value"),
        ("topp", 1e400, "topp"),
    ],
)
def test_server_rejects_bad_fields_by_name(tmp_path, field, value, msg):
    block = {"pass": 1, "doc_index": 0, "output_dir": str(tmp_path), "target_csa_layers": [1], field: value}
    with pytest.raises(DumpProtocolError, match=msg):
        parse_request({"flashmemory_dump": block}, rid="r", root=tmp_path)


@pytest.mark.parametrize("custom_params", ['{"flashmemory_dump": {}}', ["flashmemory_dump"], 7])
def test_custom_params_that_is_not_an_object_is_refused(tmp_path, custom_params):
    with pytest.raises(
        DumpProtocolError, match=f"custom_params: expected an object.*got {type(custom_params).__name__}"
    ):
        parse_request(custom_params, rid="r", root=tmp_path)


def test_a_bad_block_aborts_the_request_with_the_reason(tmp_path, monkeypatch):
    """The scheduler hook turns a refused block into sglang's own abort (the client gets HTTP 400)."""
    from types import SimpleNamespace

    from flashmemory.sglang.decode import hooks

    rec = DumpRecorder(index_topk=8, root=tmp_path)
    monkeypatch.setattr(hooks.RUNTIME, "dump", rec)
    aborted = []
    req = SimpleNamespace(
        rid="r5",
        set_finish_with_abort=aborted.append,
        sampling_params=SimpleNamespace(
            custom_params={
                "flashmemory_dump": {"pass": 1, "doc_index": 0, "output_dir": "/etc", "target_csa_layers": [1]}
            }
        ),
    )
    hooks.before_add_request(None, req)
    assert len(aborted) == 1 and "request r5" in aborted[0] and "outside the server's dump root" in aborted[0]
    assert not rec.pending


def _keys(g=None):
    """64 index-key chunks [64, 132] uint8 with finite fp8 keys and scales (the dump refuses NaN ones)."""
    from flashmemory.retriever.fp8 import quantize_chunks

    return quantize_chunks(torch.randn(64, 128, generator=g))


def _run_request(rec, rid, req, prompt, steps, kv, per_layer=None, seed=0, n_layers=3, finish=True):
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
            rec.observe_layer(
                L,
                [rid],
                lg,
                torch.tensor([n]),
                torch.tensor([pos]),
                hidden=torch.randn(1, 8, generator=g),
                new_chunks=lambda b, s, e: kv[s:e],
            )
    if finish:
        rec.begin_step([])  # request gone: finalized


def test_recorder_files_go_through_the_client_merge(tmp_path):
    """Pass 1 (generation) and pass 2 (prompt + response, 2 tokens) as the client asks for them; the server's
    files merge into one committed-ready document with pass 2's keys and pass 1's labels."""
    staging = tmp_path / ".staging"
    kw = dict(doc_index=4, output_dir=str(staging), topp=0.5, min_layers=2, target_csa_layers=(1, 2), topk_interval=2)
    r1, r2 = DumpRequest(pass_=1, **kw), DumpRequest(pass_=2, **kw)
    rec = DumpRecorder(index_topk=8, root=tmp_path)
    g = torch.Generator().manual_seed(1)
    kv1 = _keys(g)
    kv2 = _keys(g)
    prompt, steps = 40, 6
    per_layer = [[] for _ in range(3)]
    _run_request(rec, "p1", r1, prompt, steps, kv1, per_layer)
    _run_request(rec, "p2", r2, prompt + steps, 2, kv2, seed=5)  # re-prefilled prompt + response
    assert rec.written == [str(r1.doc_path()), str(r2.doc_path())]
    assert r1.doc_path() == staging / "pass1" / "doc_00004.safetensors"
    doc = merge_passes(r1, r2, rid="src:4", where="item 4")
    want = golden_labels([torch.stack(x) for x in per_layer], topk=8, topp=0.5, min_layers=2)
    assert doc.doc_index == 4 and doc.rid == "src:4" and doc.target_layers == [1, 2]
    assert torch.equal(doc.label_pointers, want.pointers) and torch.equal(doc.label_indices, want.indices)
    assert doc.n_tokens == steps and doc.n_prompt_blocks == prompt // 4
    n2 = (prompt + steps + 2) // 4  # pass 2 saw prompt + response chunks
    assert torch.equal(doc.compk[1], kv2[:n2]) and torch.equal(doc.compk[2], kv2[:n2])
    assert set(doc.native_logits) == {(L, t) for L in (1, 2) for t in range(3)}
    p1 = load_doc(r1.doc_path())  # the merge keeps pass 1's top-k store
    assert doc.native_topk_steps.tolist() == [0, 2, 4] and sorted(doc.native_topk) == [0, 1, 2]
    for C in range(3):
        assert torch.equal(doc.native_topk[C][0], p1.native_topk[C][0])
        assert torch.equal(doc.native_topk[C][1], p1.native_topk[C][1])
    writer = DumpWriter(tmp_path / "out")  # and the commit writes it
    back = load_doc(writer.dir / writer.commit(doc)["filename"])
    assert torch.equal(back.native_topk_steps, doc.native_topk_steps)
    assert all(torch.equal(back.native_topk[C][0], doc.native_topk[C][0]) for C in range(3))
    from safetensors import safe_open

    with safe_open(str(r2.doc_path()), framework="pt") as f:  # pass 2 stores no top-k
        assert not [k for k in f.keys() if k.startswith("native_topk")]


def test_merge_rejects_a_short_pass2(tmp_path):
    kw = dict(doc_index=0, output_dir=str(tmp_path), target_csa_layers=(1,), min_layers=1)
    r1, r2 = DumpRequest(pass_=1, **kw), DumpRequest(pass_=2, **kw)
    rec = DumpRecorder(index_topk=8, root=tmp_path)
    kv = _keys()
    _run_request(rec, "a", r1, 40, 8, kv)
    _run_request(rec, "b", r2, 8, 1, kv)  # far too few chunks for pass 1's steps
    with pytest.raises(DumpItemError, match="compk"):
        merge_passes(r1, r2, rid="x", where="item 0")


def _ref_topk(row, k):
    """Independent reference: plain torch.topk of the row; picks whose logit is -inf become -1, padded to k."""
    idx, val = torch.full((k,), -1, dtype=torch.int32), torch.full((k,), float("-inf"))
    v, i = torch.topk(row.float(), min(k, row.numel()))
    fin = v > float("-inf")
    idx[: v.numel()][fin] = i[fin].to(torch.int32)
    val[: v.numel()][fin] = v[fin]
    return idx, val


@pytest.mark.parametrize(
    "mode,interval,k,want_steps",
    [
        ("cycle", 4, 8, list(range(0, 30, 4))),
        ("cycle", 64, 8, [0]),
        ("all", 64, 8, list(range(30))),
        ("all", 1, 40, list(range(30))),  # k above the 32 logit columns
    ],
)
def test_recorder_stores_native_topk_of_every_layer(tmp_path, mode, interval, k, want_steps):
    """Pass 1 keeps, at the steps store_topk picks and for every c4 layer (not only targets), the native top-k
    ids + logits, -1 / -inf where fewer than k chunks are visible; it reads back through the format loader."""
    req = DumpRequest(
        pass_=1,
        doc_index=1,
        output_dir=str(tmp_path),
        target_csa_layers=(1,),
        min_layers=1,
        store_topk=mode,
        topk_interval=interval,
    )
    rec = DumpRecorder(index_topk=k, root=tmp_path)
    kv = _keys()
    per_layer = [[] for _ in range(3)]
    prompt, steps = 6, 30  # step 0 sees 1 chunk, step 29 sees 8
    _run_request(rec, "q", req, prompt, steps, kv, per_layer, seed=3, finish=False)
    st = rec.docs["q"]  # only the top-k is held, never full logits
    assert sorted(st.topk) == want_steps
    assert all(i.shape == (k,) and v.shape == (k,) for per in st.topk.values() for i, v in per.values())
    rec.begin_step([])
    doc = load_doc(req.doc_path())
    assert doc.native_topk_steps.dtype == torch.int32 and doc.native_topk_steps.tolist() == want_steps
    assert sorted(doc.native_topk) == [0, 1, 2] and doc.target_layers == [1]
    n_padded = 0
    for C in range(3):
        idx, val = doc.native_topk[C]
        assert idx.shape == (len(want_steps), k) and idx.dtype == torch.int32 and val.dtype == torch.float32
        for row, t in enumerate(want_steps):
            ref_i, ref_v = _ref_topk(per_layer[C][t], k)
            assert torch.equal(idx[row], ref_i), (C, t)
            assert torch.equal(val[row], ref_v), (C, t)
            n_padded += int((idx[row] == -1).sum())
    assert n_padded > 0  # early steps have fewer than k chunks
    assert bool((doc.native_topk[0][0][-1] >= 0).any())


def test_recorder_stores_no_topk_for_none_or_pass2(tmp_path):
    rec = DumpRecorder(index_topk=8, root=tmp_path)
    kv = _keys()
    kw = dict(doc_index=0, output_dir=str(tmp_path), target_csa_layers=(1,), min_layers=1)
    r_none, r_p2 = DumpRequest(pass_=1, store_topk="none", **kw), DumpRequest(pass_=2, store_topk="all", **kw)
    _run_request(rec, "a", r_none, 40, 5, kv)
    _run_request(rec, "b", r_p2, 40, 5, kv)
    for r in (r_none, r_p2):
        doc = load_doc(r.doc_path())
        assert doc.native_topk == {} and doc.native_topk_steps.numel() == 0
    with pytest.raises(DumpItemError, match="native top-k at steps"):  # a pass 1 lacking the asked-for top-k
        merge_passes(DumpRequest(pass_=1, store_topk="cycle", **kw), r_p2, rid="x", where="item 0")


def test_merge_rejects_topk_steps_other_than_asked(tmp_path):
    kw = dict(doc_index=0, output_dir=str(tmp_path), target_csa_layers=(1,), min_layers=1)
    r1, r2 = DumpRequest(pass_=1, topk_interval=2, **kw), DumpRequest(pass_=2, **kw)
    rec = DumpRecorder(index_topk=8, root=tmp_path)
    kv = _keys()
    _run_request(rec, "a", r1, 40, 6, kv)
    _run_request(rec, "b", r2, 46, 2, kv)
    assert merge_passes(r1, r2, rid="x").native_topk_steps.tolist() == [0, 2, 4]
    with pytest.raises(DumpItemError, match=r"steps \[0, 2, 4\].*asks for \[0, 3\]"):
        merge_passes(DumpRequest(pass_=1, topk_interval=3, **kw), r2, rid="x", where="item 0")


def test_a_failing_document_does_not_raise_into_the_scheduler(tmp_path, monkeypatch, caplog):
    """A document whose write fails (here: the disk) is logged and listed in `failed`; the next one still writes."""
    import flashmemory.sglang.dump.mode as dm

    g = torch.Generator().manual_seed(3)
    kv = _keys(g)
    rec = DumpRecorder(index_topk=8, root=tmp_path)
    kw = dict(output_dir=str(tmp_path), topp=0.5, min_layers=1, target_csa_layers=(1,))
    calls = []

    def broken(path, doc, **kw):
        calls.append(path)
        raise OSError("No space left on device")

    monkeypatch.setattr(dm, "save_doc_file", broken)
    _run_request(rec, "bad", DumpRequest(pass_=1, doc_index=0, **kw), 40, 3, kv)
    assert calls and rec.failed == ["bad"] and rec.written == []
    assert "No space left on device" in caplog.text and "bad" in caplog.text
    monkeypatch.undo()
    _run_request(rec, "good", DumpRequest(pass_=1, doc_index=1, **kw), 40, 3, kv)
    assert rec.written == [str(DumpRequest(pass_=1, doc_index=1, **kw).doc_path())]
