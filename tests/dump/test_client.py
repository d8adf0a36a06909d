import pytest

from flashmemory.dump import list_docs, load_doc, read_metadata
from flashmemory.dump.backend import DumpBackendError, DumpConfig, DumpItemError, resolve_target_layers
from flashmemory.dump.client import run_dump

from .synth import make_doc


class FakeBackend:
    """Produces synthetic docs; raises (an interruption) or fails (a bad item) where told."""

    name = "fake"
    n_c4_layers = 4

    def __init__(self, crash_at=None, bad=()):
        self.crash_at, self.bad, self.seen = crash_at, set(bad), []

    def dump_batch(self, jobs, cfg):
        for item, doc_index, rid in jobs:
            self.seen.append(item.item_index)
            if item.item_index == self.crash_at:
                raise RuntimeError("server died")
            if item.item_index in self.bad:
                yield item, DumpItemError(f"{item.where}: bad item")
                continue
            d = make_doc(doc_index, seed=item.item_index)
            d.rid = rid
            yield item, d


def _input(tmp_path, n):
    import json

    p = tmp_path / "in.jsonl"
    p.write_text(
        "".join(json.dumps({"prompt": json.dumps([{"role": "user", "content": f"q{i}"}])}) + "\n" for i in range(n))
    )
    return p


def test_resume_after_interrupt(tmp_path):
    inp, out = _input(tmp_path, 6), tmp_path / "out"
    cfg = DumpConfig(target_layers=(1, 3))
    with pytest.raises(RuntimeError, match="server died"):
        run_dump(FakeBackend(crash_at=3), inp, out, cfg, batch_size=2, progress=False)
    assert [r["item_index"] for r in read_metadata(out)] == [0, 1, 2]
    # Crash debris: a temp file and a doc that was renamed but never got its metadata line (it is complete:
    # adopted, not redone).
    from flashmemory.dump.outdir import tmp_name

    (out / tmp_name("doc_00003.safetensors", 99)).write_bytes(b"xx")
    from flashmemory.dump.writer import save_doc_file

    debris = make_doc(3, seed=3)
    debris.rid = "in.jsonl:3"
    save_doc_file(out / "doc_00003.safetensors", debris)
    fb = FakeBackend(bad={4})
    rep = run_dump(fb, inp, out, cfg, batch_size=2, progress=False)
    assert fb.seen == [4, 5] and rep.skipped_done == 4 and len(rep.failed) == 1 and "in.jsonl:5" in rep.failed[0]
    assert len(rep.recovered) == 2 and "adopted doc_00003" in rep.recovered[1]
    meta = read_metadata(out)
    assert sorted(r["item_index"] for r in meta) == [0, 1, 2, 3, 5]  # no duplicates, bad item skipped
    assert len({r["doc_index"] for r in meta}) == len(meta)
    docs = [load_doc(p) for p in list_docs(out)]  # every listed doc loads completely
    assert [d.rid for d in docs] == [f"in.jsonl:{i}" for i in (0, 1, 2, 3, 5)]
    assert sorted(p.name for p in out.glob("doc_*")) == [r["filename"] for r in meta]
    fb = FakeBackend()
    rep = run_dump(fb, inp, out, cfg, start_idx=4, progress=False)  # item 4 failed before: skipped, not retried
    assert fb.seen == [] and rep.skipped_failed == [4] and rep.incomplete and rep.skipped_done == 1
    rep = run_dump(fb, inp, out, cfg, start_idx=4, progress=False, retry_failed=True)
    assert rep.skipped_done == 1 and len(rep.committed) == 1 and len(read_metadata(out)) == 6 and not rep.incomplete


def test_slicing(tmp_path):
    inp, out = _input(tmp_path, 6), tmp_path / "o"
    fb = FakeBackend()
    run_dump(fb, inp, out, DumpConfig(target_layers=(1, 3)), start_idx=1, end_idx=5, n_samples=2, progress=False)
    assert fb.seen == [1, 2]


def test_target_layer_resolution():
    assert resolve_target_layers(None, 21) == ((10, 12, 20), "")
    layers, note = resolve_target_layers(None, 4)
    assert layers == (1, 2, 3) and "4 c4 layers" in note
    assert resolve_target_layers([3, 1], 4) == ((1, 3), "")
    with pytest.raises(DumpBackendError, match=r"\[12, 20\] do not exist"):
        resolve_target_layers([10, 12, 20], 11)
    assert resolve_target_layers(None, None)[0] == (10, 12, 20)
