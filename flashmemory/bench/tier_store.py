"""The scratch page store of the disk-tier benches (`bench tier`, `bench tier-scale`): where it lives, the check
that every page written behind reached the disk, and its teardown. What each bench times stays in its module.
"""

from __future__ import annotations

import shutil
import tempfile

from flashmemory.errors import UserError
from flashmemory.offload.disk import HostPageCache, PageStore


def store_dir(given: str | None, prefix: str) -> tuple[str, bool]:
    """(directory, owned): `--dir` as given, else a fresh temporary directory the bench owns and removes."""
    return (given, False) if given else (tempfile.mkdtemp(prefix=prefix), True)


def check_written(cache: HostPageCache, d: str, n: int, why: str = "") -> None:
    """Flush the write-behind queue; refuse (`--dir` named) when any of the n pages stayed pinned in host memory
    or failed to write, since a read of it would time host memory, not the disk. why: appended to the message."""
    cache.flush()
    if cache.pinned_pages or cache.counters.write_errors:
        raise UserError(
            f"--dir {d}: {cache.pinned_pages} of {n} pages could not be written to the page store "
            f"({cache.counters.write_errors} write errors: disk full or failing){why}"
        )


def close_store(cache: HostPageCache | None, store: PageStore, d: str, owned: bool) -> None:
    """Stop the cache's threads, close the store file and remove the directory when the bench made it."""
    if cache is not None:
        cache.close()
    store.close()
    if owned:
        shutil.rmtree(d, ignore_errors=True)
