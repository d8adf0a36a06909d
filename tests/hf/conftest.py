import pytest
import torch

from flashmemory.hf import HFEngine, load_model


@pytest.fixture(scope="session")
def micro():
    """(model, config, engine) for the shipped micro config, seed 0."""
    model, config = load_model("micro", seed=0)
    return model, config, HFEngine(model, config)


@pytest.fixture(scope="session")
def micro_ids():
    """A fixed 203-token prompt (S % 4 != 0 on purpose: a trailing partial window)."""
    g = torch.Generator().manual_seed(123)
    return torch.randint(2, 1024, (203,), generator=g)


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """These models are tiny: one torch thread (tests/conftest.py)."""
    yield
