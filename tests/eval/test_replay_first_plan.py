"""The replay's start of a request (`replay_doc(first_plan=...)`): the published frontier's step-0 plan on the
prompt's last position, or the live server's, whose first cycle runs on the first decode position and whose
request attends every chunk (copy mode) or its warm start (shrink mode) until that plan is seen."""

import pytest
import torch

from flashmemory.eval.harness import HarnessConfig
from flashmemory.eval.methods import MassPagePolicy
from flashmemory.eval.replay import replay_doc
from flashmemory.retriever.fp8 import quantize_chunks

P, T, PC, KMAX = 64, 24, 4, 2


class _Oldest:
    """Scores the oldest page high; records the positions it was asked about."""

    def __init__(self):
        self.positions = []

    def __call__(self, row, n_hist, hidden, position):
        self.positions.append(int(position))
        s = torch.zeros(n_hist)
        s[:PC] = 1.0
        return s


def _replay(first_plan, lag=0):
    g = torch.Generator().manual_seed(0)
    n_total = (P + T) // 4
    chunks = torch.stack([quantize_chunks(torch.randn(n_total, 8, generator=g)) for _ in range(2)])
    hid = {l: torch.randn(P + T, 16, generator=g) for l in range(2)}
    scorer = _Oldest()
    rep = replay_doc(
        chunks,
        hid,
        P,
        T,
        lambda e: (scorer, MassPagePolicy(PC, 0)),
        page_chunks=PC,
        kmax=KMAX,
        tau=8,
        last_keep=0,
        target_layers=(1,),
        first_plan=first_plan,
        first_plan_lag=lag,
    )
    return rep, scorer.positions


def test_prompt_is_the_default_and_plans_on_the_prompts_last_position():
    rep, pos = _replay("prompt")
    assert pos[0] == P - 1
    assert not rep.resident[0, : rep.n_visible[0]].all()


@pytest.mark.parametrize("lag", [0, 3])
def test_full_attends_everything_until_the_first_plan_made_on_the_first_decode_position(lag):
    rep, pos = _replay("full", lag)
    assert pos[0] == P, "the first cycle reads the first decode forward's hidden state"
    for t in range(1 + lag):
        assert rep.resident[t, : rep.n_visible[t]].all(), t
    t = 1 + lag
    assert not rep.resident[t, : rep.n_visible[t]].all()


def test_recency_attends_the_warm_start_then_the_plan():
    rep, _ = _replay("recency", lag=2)
    n0 = P // 4
    warm = rep.resident[0, :n0].nonzero().flatten().tolist()
    assert warm == list(range(n0 - KMAX * PC, n0)), "the newest kmax pages"
    assert rep.resident[2, :n0].nonzero().flatten().tolist() == warm
    assert rep.resident[3, :PC].all(), "the plan (the oldest page) is seen from step 1 + lag"


def test_harness_default_is_the_published_frontiers():
    assert HarnessConfig().first_plan == "prompt" and HarnessConfig().first_plan_lag == 0
    with pytest.raises(ValueError):
        _replay("later")
