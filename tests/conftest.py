import json

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
    cfg.write_text(
        json.dumps(
            {
                "train": [{"data_dir": "train", "doc_ids": None}],
                "val": [{"data_dir": "val", "doc_ids": [0]}],
                "test": [],
            }
        )
    )
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


LIVE = "tests/sglang/live/"
# Live modules that start only servers of their own (no `stock_server`, no `live_servers`): their own xdist work
# unit, so under `-n 2` they run on the other worker, beside the unit tests, instead of after the PD stacks and the
# shared servers on the live worker (that worker was the suite's critical path: 29 of its 29.5 minutes).
LIVE_OWN = tuple(
    LIVE + m
    for m in (
        "test_equivalence.py",
        "test_live_dump.py",
        "test_bad_checkpoint_startup.py",
        "test_layout_refusal.py",
        "test_eval_live.py",
    )
)
SHARED_FIXTURES = ("stock_server", "live_servers", "stock")


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config, items):
    """The live folder first (stable order otherwise): under `-n 2` the first work unit is the live folder's shared
    part and the second its own-server modules (LIVE_OWN), so one worker starts the PD stacks at once while the other
    runs the own-server modules and then the rest of the suite. Inside the shared part, the modules with servers of
    their own (PD stacks among them) come before those on the folder's shared servers (`live_servers`, started at
    first use and kept to the folder's end): both sets up at once ran this 23-GB box out of memory. Whole modules
    move, so no module fixture starts twice. A LIVE_OWN module that uses a shared server is a usage error: its
    worker would start a second copy of that server."""
    shared = {
        _module(item.nodeid)
        for item in items
        if item.nodeid.startswith(LIVE) and "live_servers" in getattr(item, "fixturenames", ())
    }
    wrong = sorted(
        {
            _module(item.nodeid)
            for item in items
            if _module(item.nodeid) in LIVE_OWN and set(SHARED_FIXTURES) & set(getattr(item, "fixturenames", ()))
        }
    )
    if wrong:
        raise pytest.UsageError(
            f"tests/conftest.py LIVE_OWN: {wrong} use a shared live server; move them out of "
            "LIVE_OWN (they would start a second copy of it on the other worker)"
        )
    items.sort(
        key=lambda item: (
            not item.nodeid.startswith(LIVE),
            _module(item.nodeid) in LIVE_OWN,
            _module(item.nodeid) in shared,
        )
    )


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist (`make test` runs `-n 2`): the live folder's shared part is one work unit, so one worker starts
    the shared servers once (two workers would each start their own: four servers each), its own-server modules
    (LIVE_OWN) a second unit, and every other test file is its own unit. xdist's group marks (`--dist loadgroup`)
    were ignored under pytest 9.2, hence a scheduler. Units go out in collection order (the order above): xdist's
    default re-sorts them by test count, which put the live unit 11th and the own-server unit 67th of 185, so the
    suite's longest unit started only once ten unit-test files had been handed out."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class LiveFolderFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = _module(nodeid)
            if module in LIVE_OWN:
                return LIVE + "#own-servers"
            return LIVE if nodeid.startswith(LIVE) else module

    return LiveFolderFirst(config, log)
