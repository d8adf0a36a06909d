import json
from pathlib import Path

import pytest

from flashmemory.train.synthetic import make_teacher, write_synthetic_dump


@pytest.fixture(scope="session")
def teacher():
    return make_teacher(layers=(0, 1), seed=0)


@pytest.fixture(scope="session")
def synth(tmp_path_factory, teacher):
    """A real flashmemory-dump/1 directory pair written by the dump writer from a random teacher:
    4 train docs and 1 val doc, plus a data config using relative paths."""
    root = tmp_path_factory.mktemp("synth")
    write_synthetic_dump(root / "train", teacher, n_docs=4, seed=0)
    write_synthetic_dump(root / "val", teacher, n_docs=1, seed=7)
    cfg = root / "data.json"
    cfg.write_text(json.dumps({"train": [{"data_dir": "train", "doc_ids": None}],
                               "val": [{"data_dir": "val", "doc_ids": [0]}], "test": []}))
    # A fit check: validate on a training doc (the held-out doc's doc-level query is unseen).
    (root / "fit.json").write_text(json.dumps({"train": ["train"], "val": [{"data_dir": "train", "doc_ids": [0]}]}))
    return root


@pytest.fixture
def one_torch_thread():
    """One torch thread for the test: tiny models and ops are as fast uncontended, and 5-10x faster on a busy
    CPU (folders with tiny work use it autouse through their own conftest)."""
    import torch
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


LIVE_DIR = Path(__file__).parent / "sglang" / "live"
# The live files that use the folder's four-server `live_servers` fixture: one group, so those servers start once.
LIVE_SHARED = {"test_full_budget_equals_stock.py", "test_small_budget.py", "test_stock_vs_gates_off.py",
               "test_live_pd.py"}


def pytest_collection_modifyitems(config, items):
    """Groups for pytest-xdist (`make test` runs `-n 2 --dist loadgroup`; the marks do nothing without xdist).
    A worker takes a whole group: the live files sharing `live_servers` are one group (their servers start once),
    the other live files (each starting its own servers) a second, and every other test module its own, so
    module-scoped fixtures are built once. Two workers on two cores: one can run live servers while the other runs
    the rest."""
    for item in items:
        path = Path(str(item.fspath))
        if LIVE_DIR in path.parents:
            group = "live-shared" if path.name in LIVE_SHARED else "live-own"
        else:
            group = str(path)
        item.add_marker(pytest.mark.xdist_group(group))
