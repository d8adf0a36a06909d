"""The page LRU shared by all requests: recall blocks in use order, oldest first."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterator


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

    def victims(self, evictable: Callable[[int], bool]) -> Iterator[int]:
        """The blocks `victim` would return one after another, oldest first, in one pass: O(blocks) in all.

        The order is snapshotted at the first `next()`. Valid while `evictable`'s answers stay fixed and the
        order changes only by removing blocks already yielded (a planning pass under the engine lock): then the
        k-th block yielded is exactly what `victim` returns after the k-1 before it were removed.
        """
        for b in list(self._order):
            if b in self._order and evictable(b):
                yield b
