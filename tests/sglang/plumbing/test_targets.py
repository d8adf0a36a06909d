import pytest

from flashmemory.env import FlashMemoryEnv
from flashmemory.sglang.plumbing.patch_spec import Patch, TargetError, check_signature
from flashmemory.sglang.plumbing.patching import select
from flashmemory.sglang.plumbing.targets import SPECS, features_for

pytestmark = pytest.mark.sglang


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.feature}:{s.target.rsplit('.', 2)[-2:]}")
def test_every_target_resolves_with_expected_signature(sg, spec):
    check_signature(spec)


def test_drift_is_reported(sg):
    bad = Patch("level2", SPECS[0].target, "around", SPECS[0].impl, ("self", "x", "renamed"), "test")
    with pytest.raises(TargetError, match="signature drift"):
        check_signature(bad)
    with pytest.raises(TargetError, match="no attribute"):
        check_signature(Patch("x", "sglang.srt.plugins.hook_registry.HookRegistry.nope", "after", "m:x", (), "test"))


def test_features():
    assert features_for(FlashMemoryEnv()) == ()
    f = features_for(FlashMemoryEnv(decode_swap_p=True, cudagraph=True, retriever_ckpt="c.pt"))
    assert f == ("level2", "mask", "path_p", "shrink", "cudagraph", "level1")
    assert "shrink" not in features_for(FlashMemoryEnv(decode_swap_p=True, pd_c4_shrink=False))
    assert "credit_c4" in features_for(FlashMemoryEnv(decode_swap_p=True, pd_credit_c4=True))
    assert "credit_c4" not in features_for(FlashMemoryEnv(decode_swap_p=True, pd_c4_shrink=False, pd_credit_c4=True))
    assert "mask" not in features_for(FlashMemoryEnv(decode_swap_p=True, score_resident=True))
    specs = select(("level2", "dump"))
    assert len({(s.target, s.kind) for s in specs}) == len(specs)  # shared indexer hook registered once
    assert [s.feature for s in specs] == ["level2", "dump", "dump", "level2"]  # the last: the start-up refusals
    refusal_steps = select(("level2", "level1"), ("step",))
    assert [s.impl for s in refusal_steps] == ["flashmemory.sglang.decode.resolution_step:refuse_at_resolution"]
    assert select(("path_i", "dump", "hisparse_prefetch"), ("step",)) == []  # nothing they refuse


def test_no_target_is_reached_only_through_an_alias():
    """A class-level alias (`forward_indexer_compressor = forward_unified`) binds the function at class creation,
    so patching the original name reaches no caller. No hooked method may have such an alias in its class, and
    the indexer compressor is hooked under the alias its callers use."""
    import importlib
    import inspect
    import re

    for s in SPECS:
        parts = s.target.split(".")
        for i in range(len(parts) - 1, 0, -1):
            try:
                owner = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            for p in parts[i:-1]:
                owner = getattr(owner, p)
            break
        if not inspect.isclass(owner):
            continue
        src = inspect.getsource(owner)
        assert not re.search(r"^\s+\w+\s*=\s*" + re.escape(parts[-1]) + r"\s*$", src, re.M), s.target
    comp = importlib.import_module("sglang.srt.layers.attention.dsv4.compressor_v2").CompressorBackendMixin
    assert "self.forward_indexer_compressor(" in inspect.getsource(
        importlib.import_module("sglang.srt.layers.attention.dsv4.indexer")
    )
    assert any(s.target.endswith("CompressorBackendMixin.forward_indexer_compressor") for s in SPECS)
    assert comp.forward_indexer_compressor is comp.forward_unified  # still an alias upstream: keep hooking the alias
