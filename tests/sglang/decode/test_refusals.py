"""sglang's DeepSeek-V4 launch layouts against FlashMemory's start-up refusals, on sglang's real `ServerArgs`
(the tiny model's config, resolved by sglang 0.5.23's own pipeline on CPU): every layout FlashMemory does not
serve stops start-up with one line naming the flag, the served ones (TP, PD decode, attention DP on a single
server) start, and with every gate off nothing is refused."""

import json
import os
import re
import sys

import pytest

from flashmemory.sglang.decode import runtime as runtime_mod
from flashmemory.sglang.decode.refusals import layout_refusals, refusals, setting
from flashmemory.sglang.decode.runtime import Runtime
from tests.sglang.decode.test_copy_adapter import env, fake_pool

pytestmark = pytest.mark.sglang
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PATH_P = ("level2", "path_p", "level1")
PD = dict(disaggregation_mode="decode", disaggregation_transfer_backend="nixl")
EAGLE = dict(speculative_algorithm="EAGLE", speculative_eagle_topk=1, speculative_num_steps=1)

# layout -> (extra ServerArgs fields, the refusal's leading words)
REFUSED = {
    "attention DP on a PD decode server": (
        dict(PD, attn_dp_size=2, tp_size=2),
        "--attn-dp-size 2 (or --dp 2 --enable-dp-attention) with --disaggregation-mode decode:",
    ),
    "attention CP": (dict(attn_cp_size=2, tp_size=2), "--attn-cp-size 2:"),
    "DSv4 prefill CP recipe": (
        dict(enable_prefill_cp=True, cp_strategy="interleave", tp_size=2),
        "--attn-cp-size 2 --enable-prefill-cp:",
    ),
    "decode CP": (dict(dcp_size=2, tp_size=2), "--dcp-size 2:"),
    "DP replicas": (dict(dp_size=2), "--dp 2:"),
    "MTP": (dict(EAGLE, speculative_num_draft_tokens=2), "--speculative-algorithm EAGLE:"),
    "MTP on a PD decode server": (dict(PD, **EAGLE, speculative_num_draft_tokens=2), "--speculative-algorithm EAGLE:"),
    "HiCache": (dict(enable_hierarchical_cache=True, disable_radix_cache=False), "--enable-hierarchical-cache:"),
    "HiCache on a PD decode server": (
        dict(PD, enable_hierarchical_cache=True, disable_radix_cache=False),
        "--enable-hierarchical-cache:",
    ),
    "two-batch overlap": (dict(enable_two_batch_overlap=True), "--enable-two-batch-overlap:"),
}
SERVED = {
    "TP 1": {},
    "TP 2": dict(tp_size=2),
    "PD decode": PD,
    "attention DP": dict(attn_dp_size=2, tp_size=2),
    "attention DP, deprecated spelling": dict(enable_dp_attention=True, dp_size=2, tp_size=2),
    "attention DP over attention-TP pairs": dict(attn_dp_size=2, tp_size=4),
}


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """build(**fields) -> sglang's resolved ServerArgs for the tiny DeepSeek-V4 on CPU (the environment variables
    its resolution sets, e.g. prefill CP's, are put back afterwards)."""
    pytest.importorskip("sglang")
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import gpu_check_cases
    from sglang.srt.server_args import ServerArgs

    d = tmp_path_factory.mktemp("cfg")
    (d / "config.json").write_text(json.dumps(gpu_check_cases.tiny_config()))
    saved = dict(os.environ)

    def make(**fields):
        kw = gpu_check_cases.engine_kwargs(str(d), 30000)
        kw.update(device="cpu", max_running_requests=4)
        if fields.get("enable_hierarchical_cache") and fields.get("disaggregation_mode") == "decode":
            kw["disaggregation_decode_enable_radix_cache"] = True  # HiCache needs the radix cache sglang drops on D
        kw.update(fields)
        sa = ServerArgs(**kw)
        sa.resolve_once()
        return sa

    yield make
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize("layout", list(REFUSED))
def test_each_layout_flashmemory_cannot_serve_is_refused_in_one_line(layout, build, monkeypatch):
    fields, flag = REFUSED[layout]
    sa = build(**fields)
    e = env("", decode_max_conc=4)
    lines = refusals(sa, e, PATH_P)
    assert [l for l in lines if l.startswith(flag)] == lines and len(lines) == 1, lines
    assert "\n" not in lines[0]
    assert refusals(sa, e, ()) == []  # gates off: stock sglang, nothing refused
    monkeypatch.setattr(runtime_mod, "server_args", lambda: sa)
    for shrink in (False, True):  # MTP and HiCache: refused in shrink mode too (the gate asks for it)
        rt = Runtime()
        rt.configure(env("", decode_max_conc=4, pd_c4_shrink=shrink), PATH_P)
        with pytest.raises(SystemExit, match="^FlashMemory startup error: " + re.escape(flag)) as ex:
            rt.attach_pool(fake_pool())
        assert isinstance(ex.value, SystemExit) and rt.engine is None  # stopped before anything is built


@pytest.mark.parametrize("layout", list(SERVED))
def test_the_served_layouts_are_not_refused(layout, build):
    sa = build(**SERVED[layout])
    assert refusals(sa, env("", decode_max_conc=4), PATH_P) == []


def test_level1_without_path_p_is_refused_the_same_layouts(build):
    """The lockstep and the failure exchange are Level 1's and the guard's, not Path-P's alone."""
    sa = build(attn_dp_size=2, tp_size=2, **PD)
    assert refusals(sa, env("", decode_max_conc=4), ("level1",))[0].startswith("--attn-dp-size 2")
    assert refusals(sa, env("", decode_max_conc=4), ("dump",)) == []  # the dump server runs sglang's own decode


def test_fields_are_read_as_sglang_resolved_them(build):
    """`--dp 2 --enable-dp-attention` keeps dp_size 2 on the record; sglang resolves it to one replica with two
    attention-DP ranks, so it is served as attention DP, not refused as data-parallel replicas (and on a PD decode
    server it is refused as attention DP)."""
    sa = build(enable_dp_attention=True, dp_size=2, tp_size=2)
    assert (sa.dp_size, sa.attn_dp_size) == (2, 1)  # the raw record
    assert (setting(sa, "dp_size"), setting(sa, "attn_dp_size")) == (1, 2)
    assert layout_refusals(sa) == []
    sa = build(enable_dp_attention=True, dp_size=2, tp_size=2, **PD)
    assert [l.split(":")[0] for l in layout_refusals(sa)] == [
        "--attn-dp-size 2 (or --dp 2 --enable-dp-attention) with --disaggregation-mode decode"
    ]


def test_mask_mode_with_the_radix_cache_is_refused_naming_the_flag(build):
    """Mask-mode Level 2 keeps one resident mask per pool loc, which requests sharing prefix pages cannot share;
    score-resident mode (per-request picks) and a server without the radix cache are served."""
    mask = ("level2", "path_p", "mask")
    e = env(decode_max_conc=4)  # the rows the tiny server runs (--max-running-requests 4)
    lines = refusals(build(disable_radix_cache=False), e, mask)
    assert len(lines) == 1 and lines[0].startswith("--disable-radix-cache is not set:")
    assert refusals(build(disable_radix_cache=True), e, mask) == []
    assert refusals(build(disable_radix_cache=False), e, PATH_P) == []
    assert refusals(build(**PD), e, mask) == []  # a PD decode server drops the radix cache
