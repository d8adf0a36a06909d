import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """These ops are tiny: one torch thread (tests/conftest.py)."""
    yield
