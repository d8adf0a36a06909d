"""The dump run: read inputs, skip what is already committed, run batches through a backend, commit.

Resume: `DumpWriter` repairs the output directory, and items of the same input file that already
have a complete document (metadata `source` + `item_index`) are skipped; new documents continue the
doc_index counter. A per-item `DumpItemError` is reported and skipped; any other exception stops
the run (non-zero exit) after everything committed so far is safely on disk.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from flashmemory.dump.backend import DumpBackend, DumpConfig, DumpItemError
from flashmemory.dump.inputs import InputItem, load_items
from flashmemory.dump.writer import DumpWriter


@dataclass
class DumpReport:
    committed: list[int] = field(default_factory=list)   # doc indices written in this run
    skipped_done: int = 0                                 # items already complete (resume)
    bad_input: list[str] = field(default_factory=list)    # malformed input lines
    failed: list[str] = field(default_factory=list)       # items the backend could not dump
    recovered: list[str] = field(default_factory=list)    # repairs made to the output directory


def select_items(items: list[InputItem], start_idx: int = 0, end_idx: int | None = None,
                 n_samples: int | None = None) -> list[InputItem]:
    """Upstream slicing: items[start_idx:end_idx], then the first n_samples."""
    chosen = [it for it in items if it.item_index >= start_idx and (end_idx is None or it.item_index < end_idx)]
    return chosen if n_samples is None else chosen[:n_samples]


def run_dump(backend: DumpBackend, input_path: str | Path, output_dir: str | Path, cfg: DumpConfig, *,
             start_idx: int = 0, end_idx: int | None = None, n_samples: int | None = None, batch_size: int = 10,
             progress: bool = True, log: TextIO = sys.stderr) -> DumpReport:
    """Dump every selected item of `input_path` into `output_dir`. Returns what happened."""
    from tqdm import tqdm
    rep = DumpReport()
    items, rep.bad_input = load_items(input_path)
    for msg in rep.bad_input:
        print(f"skipping malformed input {msg}", file=log)
    writer = DumpWriter(output_dir)
    rep.recovered = writer.recovered
    for msg in rep.recovered:
        print(f"resume: {msg}", file=log)
    source = Path(input_path).name
    done = writer.done_items(source)
    todo = []
    for it in select_items(items, start_idx, end_idx, n_samples):
        if it.item_index in done:
            rep.skipped_done += 1
        else:
            todo.append(it)
    if rep.skipped_done:
        print(f"resume: {rep.skipped_done} item(s) already dumped in {output_dir}", file=log)
    bar = tqdm(total=len(todo), desc=f"dump ({backend.name})", unit="doc", disable=not progress, file=log)
    try:
        for b0 in range(0, len(todo), max(1, batch_size)):
            batch = todo[b0:b0 + max(1, batch_size)]
            first = writer.next_doc_index
            jobs = [(it, first + i, f"{source}:{it.item_index}") for i, it in enumerate(batch)]
            for item, out in backend.dump_batch(jobs, cfg):
                if isinstance(out, DumpItemError):
                    rep.failed.append(str(out))
                    print(f"skipping {out}", file=log)
                else:
                    writer.commit(out, item_index=item.item_index, source=source, backend=backend.name,
                                  n_prompt_tokens=int(out.positions[out.target_layers[0]][0]) if out.n_tokens else None)
                    rep.committed.append(out.doc_index)
                bar.update(1)
    finally:
        bar.close()
    return rep
