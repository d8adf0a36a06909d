"""The dump run: read inputs, skip what is already committed, run batches through a backend, commit.

Resume: `DumpWriter` locks and repairs the output directory, and items of the same input file that
already have a complete document of the same content (metadata `source` + `item_index` + `item_sha256`,
the hash of the item's messages and answer) are skipped; new documents continue the doc_index counter.
An item whose content changed since (the input was edited, or it is another file of the same name) is
dumped again as a new document, with a message naming the items; the earlier document stays (it is valid
for the input it was made from). Documents of an older version carry no hash: they count as done by file
name and index, with a message saying so. A per-item `DumpItemError` is reported, recorded in `failed_items.jsonl`
(a rerun skips it unless `retry_failed`) and skipped; any other exception stops the run (non-zero exit) after
everything committed so far is safely on disk.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from flashmemory.dump.backend import DumpBackend, DumpConfig, DumpItemError
from flashmemory.dump.inputs import InputError, InputItem, load_items
from flashmemory.dump.writer import FAILED_FILE, DumpWriter


@dataclass
class DumpReport:
    committed: list[int] = field(default_factory=list)  # doc indices written in this run
    skipped_done: int = 0  # items already complete (resume)
    changed: list[int] = field(default_factory=list)  # items dumped before with other content: dumped again
    legacy_done: list[int] = field(default_factory=list)  # taken as done from a document without a content hash
    bad_input: list[str] = field(default_factory=list)  # malformed input lines
    failed: list[str] = field(default_factory=list)  # items the backend could not dump (this run)
    skipped_failed: list[int] = field(default_factory=list)  # items that failed in an earlier run, not retried
    recovered: list[str] = field(default_factory=list)  # repairs made to the output directory

    @property
    def incomplete(self) -> bool:
        """Some selected item has no document (it failed now or before): the exit status says so."""
        return bool(self.failed or self.skipped_failed)


def select_items(
    items: list[InputItem], start_idx: int = 0, end_idx: int | None = None, n_samples: int | None = None
) -> list[InputItem]:
    """Upstream slicing: items[start_idx:end_idx], then the first n_samples (all three must be >= 0)."""
    for name, v in (("start_idx", start_idx), ("end_idx", end_idx), ("n_samples", n_samples)):
        if v is not None and v < 0:
            raise InputError(f"--{name.replace('_', '-')} {v}: must be >= 0")
    chosen = [it for it in items if it.item_index >= start_idx and (end_idx is None or it.item_index < end_idx)]
    return chosen if n_samples is None else chosen[:n_samples]


def load_selection(
    input_path: str | Path, start_idx: int = 0, end_idx: int | None = None, n_samples: int | None = None
) -> tuple[list[InputItem], list[str]]:
    """(selected items, malformed-line messages). InputError when the file holds no usable item or the
    slice selects none: a dump that cannot produce anything is an error, not a quiet exit 0."""
    items, bad = load_items(input_path)
    if not items:
        why = f"all {len(bad)} non-blank line(s) are malformed (first: {bad[0]})" if bad else "it is empty"
        raise InputError(f"{input_path}: no usable input item ({why})")
    chosen = select_items(items, start_idx, end_idx, n_samples)
    if not chosen:
        raise InputError(
            f"{input_path}: --start-idx {start_idx} --end-idx {end_idx} --n-samples {n_samples} select "
            f"no item (the file has {len(items)} usable item(s), indices "
            f"{items[0].item_index}..{items[-1].item_index})"
        )
    return chosen, bad


def _some(indices: list[int], n: int = 5) -> str:
    """'items 0, 3, 7' or 'items 0, 3, 7, 9, 11, ...' (the first n)."""
    return "items " + ", ".join(map(str, indices[:n])) + (", ..." if len(indices) > n else "")


def run_dump(
    backend: DumpBackend,
    input_path: str | Path,
    output_dir: str | Path,
    cfg: DumpConfig,
    *,
    start_idx: int = 0,
    end_idx: int | None = None,
    n_samples: int | None = None,
    batch_size: int = 10,
    progress: bool = True,
    log: TextIO | None = None,
    writer: DumpWriter | None = None,
    retry_failed: bool = False,
) -> DumpReport:
    """Dump every selected item of `input_path` into `output_dir` (or into `writer`'s directory, already
    opened and locked by the caller). Returns what happened."""
    from tqdm import tqdm

    log = log if log is not None else sys.stderr  # looked up per call: a test or caller may have replaced it
    rep = DumpReport()
    selected, rep.bad_input = load_selection(input_path, start_idx, end_idx, n_samples)
    for msg in rep.bad_input:
        print(f"skipping malformed input {msg}", file=log)
    own = writer is None
    w = writer if writer is not None else DumpWriter(output_dir)
    try:
        rep.recovered = w.recovered if own else []
        for msg in rep.recovered:
            print(f"resume: {msg}", file=log)
        source = Path(input_path).name
        digests = {it.item_index: it.content_sha256() for it in selected}
        done = w.done_keys(source)
        failed_before = {} if retry_failed else w.failed_items(source, digests)
        todo = []
        for it in selected:
            have = done.get(it.item_index, set())
            if digests[it.item_index] in have or None in have:
                rep.skipped_done += 1
                if digests[it.item_index] not in have:
                    rep.legacy_done.append(it.item_index)
            elif it.item_index in failed_before:
                rep.skipped_failed.append(it.item_index)
            else:
                todo.append(it)
                if have:
                    rep.changed.append(it.item_index)
        if rep.changed:
            print(
                f"resume: {len(rep.changed)} item(s) of {source} ({_some(rep.changed)}) differ from the documents "
                f"dumped for them in {w.dir} (the input changed, or it is another file of the same name): dumping "
                "them again as new documents; the earlier documents stay",
                file=log,
            )
        if rep.legacy_done:
            print(
                f"resume: {len(rep.legacy_done)} item(s) of {source} ({_some(rep.legacy_done)}) taken as done by "
                "file name and index only (dumped by an older version, which recorded no content hash); if the "
                "input changed since, dump into a new --output-dir",
                file=log,
            )
        if rep.skipped_done:
            print(f"resume: {rep.skipped_done} item(s) already dumped in {w.dir}", file=log)
        if rep.skipped_failed:
            first = rep.skipped_failed[0]
            print(
                f"resume: skipping {len(rep.skipped_failed)} item(s) that failed in an earlier run (listed in "
                f"{w.dir / FAILED_FILE}; pass --retry-failed to try them again); item {first}: "
                f"{failed_before[first]}",
                file=log,
            )
        bar = tqdm(total=len(todo), desc=f"dump ({backend.name})", unit="doc", disable=not progress, file=log)
        try:
            for b0 in range(0, len(todo), max(1, batch_size)):
                batch = todo[b0 : b0 + max(1, batch_size)]
                first_index = w.next_doc_index
                jobs = [(it, first_index + i, f"{source}:{it.item_index}") for i, it in enumerate(batch)]
                for item, out in backend.dump_batch(jobs, cfg):
                    if isinstance(out, DumpItemError):
                        rep.failed.append(str(out))
                        print(f"skipping {out}", file=log)
                        if getattr(out, "permanent", True):
                            w.record_failure(source, item.item_index, str(out), digests[item.item_index])
                    else:
                        w.commit(
                            out,
                            item_index=item.item_index,
                            source=source,
                            backend=backend.name,
                            item_sha256=digests[item.item_index],
                            **getattr(backend, "provenance", {}),
                            n_prompt_tokens=int(out.positions[out.target_layers[0]][0]) if out.n_tokens else None,
                        )
                        rep.committed.append(out.doc_index)
                    bar.update(1)
        finally:
            bar.close()
    finally:
        if own:
            w.close()
    return rep
