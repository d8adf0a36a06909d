"""What only a GPU server would show, proven on CPU: the serving path's tensors follow the pool's device (a `meta`
pool, where mixing devices raises), the Level-2 buffers are sized once before capture and never reallocated,
configurations the plugin cannot honour are refused at start-up with one line, and the start-up memory check
counts what is really allocated (pinned rounding included, every device tensor)."""

import dataclasses
import math
import types

import pytest
import torch

from flashmemory.offload import OffloadLayout
from flashmemory.offload import mirror as mirror_mod
from flashmemory.offload.mirror import HostMirror, mirror_alloc_bytes, pinned_alloc_bytes
from flashmemory.sglang.decode import adapter_factory, hooks
from flashmemory.sglang.decode import runtime as runtime_mod
from flashmemory.sglang.decode.adapter_factory import build
from flashmemory.sglang.decode.refusals import refusals
from flashmemory.sglang.decode.retriever_load import load_serving_retriever
from flashmemory.sglang.decode.runtime import Runtime
from flashmemory.sglang.decode.tables import c4_page_table
from tests.sglang.decode.test_copy_adapter import PAGE, ckpt, env, fake_pool  # noqa: F401 (ckpt is a fixture)

pytestmark = pytest.mark.sglang
FEATURES = ("level2", "mask", "path_p", "level1")


def meta_pool(seed: int = 0):
    """The fake DSv4 pool with every c4 buffer on the `meta` device (a device unlike the CPU)."""
    pool = fake_pool(seed)
    pool.c4_kv_pool.kv_buffer = [t.to("meta") for t in pool.c4_kv_pool.kv_buffer]
    ix = pool.c4_indexer_kv_pool
    ix.index_k_with_scale_buffer = [t.to("meta") for t in ix.index_k_with_scale_buffer]
    return pool


def tensors(obj, path="", seen=None, depth=0):
    """(path, tensor) of every tensor reachable from `obj` through flashmemory objects, containers, closures and
    modules (parameters and buffers)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 8:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, torch.nn.Module):
        for n, t in [*obj.named_parameters(), *obj.named_buffers()]:
            yield f"{path}.{n}", t
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, f"{path}[{k!r}]", seen, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors(v, f"{path}[{i}]", seen, depth + 1)
    elif callable(obj) and getattr(obj, "__closure__", None):
        for i, c in enumerate(obj.__closure__):
            try:
                yield from tensors(c.cell_contents, f"{path}<{i}>", seen, depth + 1)
            except ValueError:
                pass
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("flashmemory"):
        for k, v in vars(obj).items():
            yield from tensors(v, f"{path}.{k}", seen, depth + 1)


# Host-side by design: the host mirror, the adapter's host row ids, layout constants.
HOST = (".engine.mirror.", ".step_rows", ".layout.", ".core.")


def test_serving_runtime_follows_the_pool_device(ckpt, monkeypatch):
    e = env(ckpt)
    monkeypatch.setattr(runtime_mod, "server_args", lambda: None)
    rt = Runtime()
    rt.configure(e, FEATURES, load_serving_retriever(e))  # loaded on the CPU, as the plugin does
    rt.attach_pool(meta_pool())
    assert rt.engine is not None and rt.engine.device.type == "meta"
    params = [*rt.retriever.named_parameters(), *rt.retriever.named_buffers()]
    assert params and {n: t.device.type for n, t in params} == {n: "meta" for n, _ in params}
    assert rt.bufs is not None and rt.bufs.sel_pages.device.type == rt.bufs.back_pages.device.type == "meta"
    off = [
        (p, t.device) for p, t in tensors(rt.engine, "eng") if t.device.type != "meta" and not any(h in p for h in HOST)
    ]
    assert off == []
    # the Level-1 inputs land on the pool's device, and the scorer runs there (CPU weights would raise here)
    x, pos = torch.empty(2, 16, device="meta"), torch.zeros(2, dtype=torch.int64, device="meta")
    rt.capture_sideband_input(1, x, pos, capturing=False)
    assert {t.device.type for _, t in tensors(rt.sideband)} == {"meta"}
    keys = torch.empty(5, 128, device="meta")
    assert rt.retriever.layer(1)(x[:1], pos[:1], keys).device.type == "meta"
    rt.engine.close()


@dataclasses.dataclass
class _Md:
    page_table: torch.Tensor
    compressed_seq_lens: torch.Tensor


def _batch(n: int):
    """A decode batch of n requests, request i on pool page i + 1 with 128 tokens of history."""
    r2t = torch.full((n + 1, 4 * PAGE), -1, dtype=torch.int64)
    for i in range(n):
        r2t[i + 1, :PAGE] = torch.arange(PAGE) + (i + 1) * PAGE
    mode = types.SimpleNamespace(is_idle=lambda: False, is_decode=lambda: True)
    fb = types.SimpleNamespace(
        forward_mode=mode,
        rids=[f"r{i}" for i in range(n)],
        seq_lens=torch.full((n,), 128),
        req_pool_indices=torch.arange(1, n + 1),
    )
    return fb, r2t


def test_level2_buffers_are_sized_once_before_capture_and_never_reallocated(monkeypatch):
    """sglang's DSv4 default --max-running-requests (256) is above the plugin's old 128-row default, and the CUDA
    graphs may stop at a smaller batch: the buffers must hold the largest batch from the start."""
    e = env("", decode_max_conc=4)
    sa = types.SimpleNamespace(max_running_requests=4, cuda_graph_max_bs_decode=2)
    monkeypatch.setattr(runtime_mod, "server_args", lambda: sa)
    rt = Runtime()
    rt.configure(e, FEATURES + ("cudagraph",))
    monkeypatch.setattr(hooks, "RUNTIME", rt)
    rt.attach_pool(fake_pool(5))
    runner = types.SimpleNamespace(server_args=sa, max_running_requests=4, device="cpu", is_draft_worker=False)
    hooks.before_init_cuda_graphs(runner)  # the capture point
    bufs, ptr = rt.bufs, rt.bufs.sel_pages.data_ptr()
    assert bufs.sel_pages.shape[0] == 4
    for n in (1, 2, 3, 4):  # batches past the graphs' largest (2)
        fb, r2t = _batch(n)
        rt.before_forward(fb, r2t)
        md = _Md(c4_page_table(r2t, fb.req_pool_indices, fb.seq_lens, PAGE).int(), fb.seq_lens // 4)
        hooks._resident_metadata(md, 0)  # the score-resident view reads them too
        assert rt.bufs is bufs and rt.bufs.sel_pages.data_ptr() == ptr and rt.bufs.back_pages is bufs.back_pages
    with pytest.raises(runtime_mod.Level2CapacityError, match="5 rows exceeds the Level-2 buffers' 4 rows"):
        rt.level2_buffers(5, "cpu")
    assert rt.bufs is bufs
    rt.engine.close()


def _args(**kw):
    base = dict(
        enable_two_batch_overlap=False,
        dsa_topk_backend="sgl-kernel",
        speculative_algorithm=None,
        max_running_requests=4,
    )
    base.update(kw)
    return types.SimpleNamespace(**base)


@pytest.mark.parametrize(
    "kw, features, flag",
    [
        (dict(enable_two_batch_overlap=True), ("level2", "path_p"), "--enable-two-batch-overlap"),
        (dict(dsa_topk_backend="flashinfer"), ("level2", "mask", "path_p"), "--dsa-topk-backend flashinfer"),
        (dict(speculative_algorithm="EAGLE"), ("level2", "path_p"), "--speculative-algorithm EAGLE"),
        (
            dict(max_running_requests=256),
            ("level2", "path_p"),
            "--max-running-requests 256 exceeds SGLANG_PATHP_DECODE_MAX_CONC=4",
        ),
    ],
)
def test_start_up_refuses_what_the_plugin_cannot_honour(kw, features, flag, monkeypatch):
    e = env("", decode_max_conc=4)
    lines = refusals(_args(**kw), e, features)
    assert len(lines) == 1 and lines[0].startswith(flag) and "\n" not in lines[0]
    assert refusals(_args(), e, features) == []
    monkeypatch.setattr(runtime_mod, "server_args", lambda: _args(**kw))
    rt = Runtime()
    rt.configure(e, features)
    with pytest.raises(SystemExit, match=f"^FlashMemory startup error: {flag}") as ex:
        rt.attach_pool(fake_pool())
    assert isinstance(ex.value, SystemExit) and rt.engine is None  # refused before anything is built


def test_what_is_refused_and_what_is_not():
    e = env("", decode_max_conc=4)
    assert refusals(_args(dsa_topk_backend="flashinfer"), e, ("level2", "path_p")) == []  # score-resident
    assert refusals(_args(enable_two_batch_overlap=True), e, ("dump",)) == []
    assert refusals(None, e, FEATURES) == []


def test_refusals_read_sglangs_real_flag_names():
    sg = pytest.importorskip("sglang.srt.server_args")
    sa = sg.prepare_server_args(
        ["--model-path", "/nonexistent", "--enable-two-batch-overlap", "--dsa-topk-backend", "flashinfer"]
        + ["--disable-radix-cache"]  # mask mode with the radix cache is refused too (test_refusals.py)
    )
    lines = refusals(sa, env("", decode_max_conc=4), ("level2", "mask", "path_p"))
    assert [l.split(":")[0] for l in lines] == ["--enable-two-batch-overlap", "--dsa-topk-backend flashinfer"]


def test_the_hook_refuses_the_model_runners_max_running_requests(monkeypatch):
    monkeypatch.setattr(runtime_mod, "server_args", lambda: None)
    rt = Runtime()
    rt.configure(env("", decode_max_conc=4), ("level2", "path_p", "level1"))
    monkeypatch.setattr(hooks, "RUNTIME", rt)
    runner = types.SimpleNamespace(server_args=types.SimpleNamespace(), max_running_requests=256, device="cpu")
    with pytest.raises(SystemExit, match="--max-running-requests 256 exceeds SGLANG_PATHP_DECODE_MAX_CONC=4"):
        hooks.before_init_cuda_graphs(runner)


def _pow2(n: int) -> int:
    return 2 ** math.ceil(math.log2(n)) if n > 0 else 0


def test_pinned_rounding_is_what_the_mirror_allocates(monkeypatch):
    assert [pinned_alloc_bytes(n, True) for n in (0, 1, 3, 4, 5, 3 << 20)] == [0, 1, 4, 4, 8, 4 << 20]
    assert pinned_alloc_bytes(3 << 20, False) == 3 << 20
    made = []
    monkeypatch.setattr(
        mirror_mod, "_host_empty", lambda shape, pin: made.append((shape, pin)) or torch.zeros(shape, dtype=torch.uint8)
    )
    lay = OffloadLayout(n_layers=3, target_layers=(1,), index_offload=True)
    m = HostMirror(lay, 37, pin=True)
    want = sum(_pow2(math.prod(s)) for s, pin in made if pin)
    assert len(made) == 2 and mirror_alloc_bytes(lay, 37, True) == m.allocated_bytes == want
    assert want > m.physical_bytes  # the rounding is real memory


@pytest.mark.parametrize("shrink", [False, True])
def test_start_up_memory_check_counts_what_is_allocated(shrink, monkeypatch):
    """Host: the mirror as the pinned allocator reserves it (CUDA present, pinning recorded); device: every
    tensor the adapter allocates on the pool's device, summed from a `meta` build."""
    seen = {}
    monkeypatch.setattr(adapter_factory, "check_host_memory", lambda n, processes=1: seen.setdefault("host", n))
    monkeypatch.setattr(adapter_factory, "check_reserve_memory", lambda n, free: seen.setdefault("device", n))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    made = []
    monkeypatch.setattr(
        mirror_mod, "_host_empty", lambda shape, pin: made.append((shape, pin)) or torch.zeros(shape, dtype=torch.uint8)
    )
    pool = meta_pool(6)
    own = {id(t) for t in [*pool.c4_kv_pool.kv_buffer, *pool.c4_indexer_kv_pool.index_k_with_scale_buffer]}
    eng = build(pool, env("", index_k_offload=True), shrink=shrink)
    allocated = {
        id(t): t for _, t in tensors(eng, "eng") if t.device.type == "meta" and t._base is None and id(t) not in own
    }
    assert seen["device"] == sum(t.numel() * t.element_size() for t in allocated.values())
    assert all(pin for _, pin in made) and seen["host"] == sum(_pow2(math.prod(s)) for s, _ in made)
    eng.close()
