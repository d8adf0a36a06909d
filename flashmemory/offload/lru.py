"""The page LRU shared by all requests: recall blocks in use order, oldest first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

PAGE_SCAN_PAUSE = 128  # blocks a victim scan examines between two `PAUSE` marks (the recaller's use)
PAUSE = -1  # what `victims` yields at a pause (block ids are >= 0)


class PageLRU:
    """Recall blocks holding a published page, least recently used first. Keys are block ids."""

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block: int) -> bool:
        return block in self._order

    def __iter__(self) -> Iterator[int]:
        return iter(self._order)

    def touch(self, block: int) -> None:
        """Insert or move to most recently used."""
        self._order[block] = None
        self._order.move_to_end(block)

    def remove(self, block: int) -> None:
        self._order.pop(block, None)

    def victim(self, evictable: Callable[[int], bool]) -> int | None:
        """Oldest block for which `evictable(block)` holds, or None. Does not remove it. O(blocks) per call."""
        for b in self._order:
            if evictable(b):
                return b
        return None

    def victims(self, evictable: Callable[[int], bool], pause_every: int = 0) -> Iterator[int]:
        """The blocks `victim` would return one after another, oldest first, in one pass: O(blocks) in all.

        The order is snapshotted at the first `next()`. Valid while `evictable`'s answers stay fixed and the
        order changes only by removing blocks already yielded (a planning pass under the engine lock): then the
        k-th block yielded is exactly what `victim` returns after the k-1 before it were removed.
        pause_every > 0: also yield PAUSE (-1) after every `pause_every` blocks examined, so a caller can bound
        the work done per lock hold and resume the scan in the next one.
        """
        for n, b in enumerate(list(self._order), 1):
            if b in self._order and evictable(b):
                yield b
            if pause_every and n % pause_every == 0:
                yield PAUSE
