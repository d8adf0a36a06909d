import pytest

from flashmemory.env import FlashMemoryEnv
from flashmemory.sglang.targets import SPECS, HookSpec, TargetError, check_signature, features_for, specs_for

pytestmark = pytest.mark.sglang


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.feature}:{s.target.rsplit('.', 2)[-2:]}")
def test_every_target_resolves_with_expected_signature(sg, spec):
    check_signature(spec)


def test_drift_is_reported(sg):
    bad = HookSpec("level2", SPECS[0].target, "around", ("self", "x", "renamed"), "around_forward_c4_indexer")
    with pytest.raises(TargetError, match="signature drift"):
        check_signature(bad)
    with pytest.raises(TargetError, match="no attribute"):
        check_signature(HookSpec("x", "sglang.srt.plugins.hook_registry.HookRegistry.nope", "after", (), "x"))


def test_features():
    assert features_for(FlashMemoryEnv()) == ()
    f = features_for(FlashMemoryEnv(decode_swap_p=True, cudagraph=True, retriever_ckpt="c.pt"))
    assert f == ("level2", "mask", "path_p", "shrink", "cudagraph", "level1")
    assert "shrink" not in features_for(FlashMemoryEnv(decode_swap_p=True, pd_c4_shrink=False))
    assert "credit_c4" in features_for(FlashMemoryEnv(decode_swap_p=True, pd_credit_c4=True))
    assert "credit_c4" not in features_for(FlashMemoryEnv(decode_swap_p=True, pd_c4_shrink=False, pd_credit_c4=True))
    assert "mask" not in features_for(FlashMemoryEnv(decode_swap_p=True, score_resident=True))
    specs = specs_for(("level2", "dump"))
    assert len({(s.target, s.hook_type) for s in specs}) == len(specs)  # shared indexer hook registered once
