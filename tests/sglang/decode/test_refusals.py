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

    def make(resolve=True, **fields):
        kw = gpu_check_cases.engine_kwargs(str(d), 30000)
        kw.update(device="cpu", max_running_requests=4)
        if fields.get("enable_hierarchical_cache") and fields.get("disaggregation_mode") == "decode":
            kw["disaggregation_decode_enable_radix_cache"] = True  # HiCache needs the radix cache sglang drops on D
        kw.update(fields)
        sa = ServerArgs(**kw)
        if resolve:
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


@pytest.fixture
def launcher(monkeypatch):
    """This process as sglang's launcher with the plugin registered for Path-P: the gates in `RUNTIME` and the
    hook table's `step` rows applied through the one apply loop (sglang's resolution hooks and the applied set are
    put back afterwards)."""
    from sglang.srt.arg_groups import resolution_hooks

    from flashmemory.sglang.plumbing import patching

    monkeypatch.setattr(resolution_hooks, "_HOOKS", {})
    monkeypatch.setattr(runtime_mod.RUNTIME, "applied_patches", {})
    monkeypatch.setattr(runtime_mod.RUNTIME, "env", env("", decode_max_conc=4))
    monkeypatch.setattr(runtime_mod.RUNTIME, "features", PATH_P)
    rows = patching.select(PATH_P, ("step",))
    assert [p.impl.rsplit(":", 1)[1] for p in rows] == ["refuse_at_resolution"]  # one hook for both features
    patching.apply(rows)
    return resolution_hooks


@pytest.mark.parametrize("layout", list(REFUSED))
def test_the_launcher_refuses_while_resolving_the_server_args(layout, build, launcher):
    """Inside sglang's own resolution (`resolve_once`, which every launcher runs before it starts a scheduler or
    the data-parallel controller) the same one line stops the process: the refusal does not depend on any
    scheduler noticing."""
    fields, flag = REFUSED[layout]
    sa = build(resolve=False, **fields)
    with pytest.raises(SystemExit, match="^FlashMemory startup error: " + re.escape(flag)) as ex:
        sa.resolve_once()
    ours = dict(launcher._HOOKS)
    launcher._HOOKS.clear()  # resolved as a scheduler receives the record, then refused there
    same = refusals(build(**fields), env("", decode_max_conc=4), PATH_P)
    launcher._HOOKS.update(ours)
    assert ex.value.code == "FlashMemory startup error: " + "; ".join(same) and len(same) == 1
    assert getattr(sa, "_resolution_finished", False) is False  # the record never became a resolved one


@pytest.mark.parametrize("layout", list(SERVED))
def test_the_launcher_resolves_the_served_layouts(layout, build, launcher):
    sa = build(resolve=False, **SERVED[layout])
    sa.resolve_once()
    assert sa._resolution_finished


def test_the_launcher_refuses_nothing_with_the_gates_off(build, launcher, monkeypatch):
    monkeypatch.setattr(runtime_mod.RUNTIME, "features", ())
    sa = build(resolve=False, dp_size=2)
    sa.resolve_once()
    assert sa._resolution_finished


def test_a_step_that_sglang_did_not_keep_stops_startup(monkeypatch):
    """The apply loop verifies a `step` row like a hook: registered but not among the wrappers sglang's pipeline
    runs is one startup line, not a silently missing refusal."""
    from sglang.srt.arg_groups import resolution_hooks

    from flashmemory.sglang.plumbing import patching

    monkeypatch.setattr(resolution_hooks, "_HOOKS", {})
    monkeypatch.setattr(runtime_mod.RUNTIME, "applied_patches", {})
    monkeypatch.setattr(resolution_hooks, "register_resolution_hook", lambda name: lambda fn: fn)  # drops it
    with pytest.raises(patching.StartupError, match="validate_deepep_v2_dispatch_token_budget is not wrapped"):
        patching.apply(patching.select(PATH_P, ("step",)))
