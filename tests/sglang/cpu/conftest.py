import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """These ops are tiny: one torch thread is as fast uncontended and much faster on a busy CPU."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
