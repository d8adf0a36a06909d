"""The three fixes that let sglang's `fake` transfer backend run a PD stack on CPU, each against sglang's own code."""

import types

import pytest

pytest.importorskip("sglang")
from sglang.srt.arg_groups import resolution_hooks as rh  # noqa: E402
from sglang.srt.arg_groups.overrides import resolved_view  # noqa: E402
from sglang.srt.arg_groups.pd_disaggregation_hook import handle_pd_disaggregation  # noqa: E402
from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer  # noqa: E402
from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

from flashmemory.sglang.cpu import pd  # noqa: E402


def _args(mode: str, backend: str) -> ServerArgs:
    return ServerArgs(model_path="/unused", disaggregation_mode=mode, disaggregation_transfer_backend=backend)


def test_fake_prefill_passes_the_pd_resolution_step(monkeypatch):
    monkeypatch.setattr(rh, "_HOOKS", {})
    sa = _args("prefill", "fake")
    with pytest.raises(AssertionError, match="fake"):
        rh.run_hook(handle_pd_disaggregation, sa)  # as shipped
    rh.register_resolution_hook("handle_pd_disaggregation")(pd.fake_prefill_step)
    rh.run_hook(handle_pd_disaggregation, sa)
    assert resolved_view(sa).disaggregation_transfer_backend == "fake"


def test_other_modes_go_through_unchanged(monkeypatch):
    monkeypatch.setattr(rh, "_HOOKS", {})
    rh.register_resolution_hook("handle_pd_disaggregation")(pd.fake_prefill_step)
    sa = _args("decode", "nixl")
    rh.run_hook(handle_pd_disaggregation, sa)
    assert resolved_view(sa).disaggregation_transfer_backend == "nixl"


def test_fake_gets_the_plain_bootstrap_server():
    assert get_kv_class(TransferBackend.FAKE, KVClassType.BOOTSTRAP_SERVER) is None  # as shipped
    assert (
        pd.around_get_kv_class(get_kv_class, TransferBackend.FAKE, KVClassType.BOOTSTRAP_SERVER)
        is CommonKVBootstrapServer
    )
    fake_mgr = get_kv_class(TransferBackend.FAKE, KVClassType.MANAGER)
    assert pd.around_get_kv_class(get_kv_class, TransferBackend.FAKE, KVClassType.MANAGER) is fake_mgr


@pytest.mark.parametrize("backend,expected", [("fake", True), ("nixl", False)])
def test_router_requests_are_fake_only_with_the_fake_backend(monkeypatch, backend, expected):
    import sglang.srt.runtime_context as rc
    from sglang.srt.disaggregation.utils import _is_fake_transfer

    monkeypatch.setattr(rc, "get_disagg", lambda: types.SimpleNamespace(disaggregation_transfer_backend=backend))
    monkeypatch.setattr("sglang.srt.disaggregation.utils.get_disagg", rc.get_disagg, raising=False)
    req = types.SimpleNamespace(bootstrap_host="127.0.0.1")  # what the router sends: P's host
    assert _is_fake_transfer(req) is False  # as shipped: only 2.2.2.2 (or no host) is fake
    assert pd.around_is_fake_transfer(_is_fake_transfer, req) is expected
    assert pd.around_is_fake_transfer(_is_fake_transfer, types.SimpleNamespace(bootstrap_host="2.2.2.2"))
