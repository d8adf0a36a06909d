"""Decoded documents -> the dump format (the retriever's training input). Shared by the demo (stage 3) and by
`flashmemory.sglang.cpu.tiny_retriever` (the serving-tiny model's retriever), so neither imports the other."""

from __future__ import annotations

from pathlib import Path

from flashmemory.eval.decode import DocRun


def dump_runs(runs: list[DocRun], out: Path, engine, targets: tuple[int, ...], start: int, *, topp: float,
              min_layers: int, max_tokens: int) -> None:
    """Commit `runs` (each with its capture `run.cap`) under `out` in the dump format, doc indices from `start`.

    topp / min_layers: the golden-label nucleus per layer and the layer votes a golden chunk needs; max_tokens: the
    decode steps each document was run for; engine: the `HFEngine` the runs came from (index top-k, c4 layers)."""
    from flashmemory.dump.backend import DumpConfig
    from flashmemory.dump.hf_backend import doc_from_capture
    from flashmemory.dump.writer import DumpWriter
    writer = DumpWriter(out)
    dcfg = DumpConfig(topp=topp, min_layers=min_layers, target_layers=targets, max_tokens=max_tokens)
    for i, run in enumerate(runs):
        doc = doc_from_capture(run.cap, run.prompt_ids, run.response_ids, dcfg, doc_index=start + i, rid=run.name,
                               index_topk=engine.index_topk, n_c4_layers=engine.n_c4_layers)
        writer.commit(doc, source="demo", item_index=start + i)
