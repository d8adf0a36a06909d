import importlib

import pytest


@pytest.fixture(scope="module")
def sg():
    """Import the sglang modules the tests need once per module (importing sglang takes several seconds)."""
    pytest.importorskip("sglang")
    return {
        "indexer": importlib.import_module("sglang.srt.layers.attention.dsv4.indexer"),
        "server_args": importlib.import_module("sglang.srt.server_args"),
    }
