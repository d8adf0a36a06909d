import pytest
import torch

from flashmemory.labels import LabelsCSR, LabelsError


def test_round_trip_rows():
    rows = [[(5, 3), (1, 2)], [], [(0, 4)], [], [(7, 1), (2, 1), (9, 1)]]
    csr = LabelsCSR.from_rows(rows)
    assert csr.n_tokens == 5 and csr.pointers.tolist() == [0, 2, 2, 3, 3, 6]
    assert csr.to_rows() == rows
    idx, sc = csr.row(4)
    assert idx.tolist() == [7, 2, 9] and sc.tolist() == [1, 1, 1]
    assert csr.row_ids().tolist() == [0, 0, 2, 4, 4, 4]
    again = LabelsCSR.from_entries(csr.row_ids(), csr.indices, csr.scores, csr.n_tokens)
    assert again.to_rows() == rows
    assert LabelsCSR.empty(3).to_rows() == [[], [], []]


@pytest.mark.parametrize(
    "ind,sc,ptr,msg",
    [
        ([1, 2], [1], [0, 2], "scores"),
        ([1, 2], [1, 1], [0, 3], "end at 2"),
        ([1, 2], [1, 1], [1, 2], "start at 0"),
        ([1, 2, 3], [1, 1, 1], [0, 2, 1, 3], "decrease"),
        ([-1], [1], [0, 1], "negative"),
    ],
)
def test_validation(ind, sc, ptr, msg):
    with pytest.raises(LabelsError, match=msg):
        LabelsCSR(
            torch.tensor(ind, dtype=torch.int32),
            torch.tensor(sc, dtype=torch.int32),
            torch.tensor(ptr, dtype=torch.int32),
        )


def test_dtype_checked():
    with pytest.raises(LabelsError, match="int32"):
        LabelsCSR(torch.tensor([1]), torch.tensor([1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32))
