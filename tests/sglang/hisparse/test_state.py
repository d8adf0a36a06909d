"""The HiSparse prefetch mode's process state (flashmemory/sglang/hisparse/state.py): a Level-1 resident
set turned into hint positions."""

from __future__ import annotations

import pytest
import torch

from flashmemory.sglang.hisparse.state import resident_hint

pytestmark = pytest.mark.sglang


def test_resident_hint_expands_pages_and_leaves_the_tail():
    pos = resident_hint(torch.tensor([3, -1, 0, 5]), n_entries=330, tail=40)
    assert pos.tolist() == list(range(192, 256)) + list(range(0, 64))  # page 5 starts at 320 >= 330 - 40
    assert resident_hint(torch.tensor([0]), n_entries=10, tail=0).tolist() == list(range(9))  # never L-1
