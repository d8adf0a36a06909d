"""`--tp N` on CPU: the thread groups, the gloo groups without NCCL, DSv4's single KV head (`cpu/patches_tp.py`)."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
import types

import pytest
import torch

from flashmemory.sglang.cpu.patches_tp import (
    TP_PATCHES,
    bind_threads_per_rank,
    check_dsv4_tp,
    cpu_inplace_all_reduce,
    cpu_pad_fill_value,
    gloo_group_without_nccl,
    keep_dsv4_kv_head,
    split_cpus,
)
from flashmemory.sglang.plumbing.patch_spec import check_signature

numa_utils = pytest.importorskip("sglang.srt.utils.numa_utils")


def test_split_cpus_covers_every_cpu_once_in_contiguous_groups() -> None:
    cpus = list(range(7))
    groups = [split_cpus(cpus, 3, i) for i in range(3)]
    assert groups == [[0, 1, 2], [3, 4], [5, 6]]
    assert [split_cpus([4, 9], 3, i) for i in range(3)] == [[4], [9], [4]]  # fewer CPUs than ranks: shared
    with pytest.raises(ValueError, match="index 2"):
        split_cpus(cpus, 2, 2)


def test_more_ranks_than_numa_nodes_bind_a_share_of_the_affinity(monkeypatch) -> None:
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("sglang.srt.utils.common.get_cpu_ids_by_node", lambda: ["0,1"])  # one NUMA node
    monkeypatch.setattr(numa_utils, "get_cpu_ids_by_node", lambda: ["0,1"])
    with pytest.raises(AssertionError, match="SGLANG_CPU_OMP_THREADS_BIND is not set"):
        numa_utils.init_threads_binding(numa_index=1, world_size=2)  # stock sglang: refuses
    cpus = sorted(os.sched_getaffinity(0))
    got = [bind_threads_per_rank(numa_utils.init_threads_binding, numa_index=i, world_size=2) for i in range(2)]
    assert got == [",".join(map(str, split_cpus(cpus, 2, i))) for i in range(2)]


def test_sglang_binding_stays_when_it_can_run(monkeypatch) -> None:
    calls = []

    def original(*, numa_index: int, world_size: int) -> str:
        calls.append((numa_index, world_size))
        return "sglang's"

    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0|1")  # the user's groups win
    assert bind_threads_per_rank(original, numa_index=1, world_size=2) == "sglang's"
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND")
    monkeypatch.setattr("sglang.srt.utils.common.get_cpu_ids_by_node", lambda: ["0", "1"])  # a node per rank
    assert bind_threads_per_rank(original, numa_index=0, world_size=2) == "sglang's"
    assert calls == [(1, 2), (0, 2)]


def test_gloo_groups_get_no_pynccl_and_no_custom_allreduce() -> None:
    seen = []

    def original(group_ranks, local_rank, backend, **kw):
        seen.append((backend, kw))

    gloo_group_without_nccl(original, [[0, 1]], 0, "gloo", group_name="tp")
    gloo_group_without_nccl(original, [[0, 1]], 0, "nccl", group_name="tp")
    assert seen == [
        ("gloo", {"group_name": "tp", "use_pynccl": False, "use_custom_allreduce": False}),
        ("nccl", {"group_name": "tp"}),
    ]


def config(arch: str, heads: int, groups: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        hf_config=types.SimpleNamespace(
            architectures=[arch], num_attention_heads=heads, o_groups=groups, num_key_value_heads=1
        )
    )


def test_dsv4_keeps_its_single_kv_head_and_other_models_go_to_sglang() -> None:
    padded = []

    def original(model_config, load_config, tp_size):
        padded.append(tp_size)
        model_config.hf_config.num_key_value_heads = tp_size
        return model_config

    dsv4 = config("DeepseekV4ForCausalLM", 8, 2)
    assert keep_dsv4_kv_head(original, dsv4, None, 2) is dsv4 and dsv4.hf_config.num_key_value_heads == 1
    other = config("LlamaForCausalLM", 8, 1)
    keep_dsv4_kv_head(original, other, None, 2)
    assert padded == [2] and other.hf_config.num_key_value_heads == 2


def test_dsv4_that_cannot_split_is_one_line() -> None:
    with pytest.raises(SystemExit, match=r"--tp 4: DeepSeek-V4's num_attention_heads \(8\) and o_groups \(2\)"):
        keep_dsv4_kv_head(lambda *a: None, config("DeepseekV4ForCausalLM", 8, 2), None, 4)
    assert check_dsv4_tp(config("x", 8, 2).hf_config, 2) is None


def test_dsv4_backend_pads_a_dp_batch_on_cpu_with_its_cuda_fill_value() -> None:
    """DP attention pads each rank's batch with `get_cpu_graph_seq_len_fill_value()` on CPU, which sglang's DSv4
    backend lacks; after its __init__ hook the name answers the backend's CUDA fill value (1)."""
    from sglang.srt.layers.attention.deepseek_v4_backend import DeepseekV4AttnBackend

    backend = object.__new__(DeepseekV4AttnBackend)  # the real class, without building a model runner
    with pytest.raises(AttributeError, match="get_cpu_graph_seq_len_fill_value"):
        backend.get_cpu_graph_seq_len_fill_value()  # stock: the first padded forward stops here
    cpu_pad_fill_value(None, backend)
    assert backend.get_cpu_graph_seq_len_fill_value() == backend.get_cuda_graph_seq_len_fill_value() == 1

    class OwnCpuValue(DeepseekV4AttnBackend):
        def get_cpu_graph_seq_len_fill_value(self) -> int:
            return 7

    own = object.__new__(OwnCpuValue)
    cpu_pad_fill_value(None, own)
    assert own.get_cpu_graph_seq_len_fill_value() == 7 and "get_cpu_graph_seq_len_fill_value" not in vars(own)


def _reduce_rank(rank: int, init: str, out: "mp.Queue") -> None:
    """One of two gloo ranks: sglang's op on a CPU tensor (stock: no CPU kernel), then the row's version."""
    try:
        import torch.distributed as dist
        from sglang.srt.distributed import parallel_state as ps

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
        coordinator = types.SimpleNamespace(unique_name="fm_test_tp", device_group=dist.group.WORLD)
        ps._groups["fm_test_tp"] = lambda: coordinator
        tokens = torch.tensor([rank + 1, 10 * (rank + 1)], dtype=torch.int32)
        try:
            ps.inplace_all_reduce(tokens.clone(), group_name="fm_test_tp")
            stock = "ran"
        except (NotImplementedError, RuntimeError) as e:
            stock = type(e).__name__ + ": " + str(e).splitlines()[0]
        cpu_inplace_all_reduce(ps.inplace_all_reduce, tokens, "fm_test_tp")
        try:
            cpu_inplace_all_reduce(ps.inplace_all_reduce, tokens.clone(), "fm_no_such_group")
            missing = ""
        except ValueError as e:
            missing = str(e)
        out.put((rank, stock, tokens.tolist(), missing))
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, traceback.format_exc(), None, None))


def test_dp_token_gather_sums_cpu_tensors_over_the_named_gloo_group(tmp_path) -> None:
    """`_dp_gather_via_all_reduce` sums the int32 token buffer with `sglang::inplace_all_reduce`, registered for
    CUDA only: on a CPU tensor sglang's op finds no kernel; the row sums it in place over the group's gloo group."""
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_reduce_rank, args=(r, f"file://{tmp_path / 'rdv'}", out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = {}
        for _ in procs:
            rank, stock, tokens, missing = out.get(timeout=120)
            assert tokens is not None, stock
            got[rank] = (stock, tokens, missing)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for stock, tokens, missing in got.values():
        assert stock != "ran" and "CPU" in stock, stock  # stock: no CPU kernel for the op
        assert tokens == [3, 30]  # (1 + 2, 10 + 20), in place, on both ranks
        assert "'fm_no_such_group' is not registered" in missing


def test_non_cpu_tensors_go_to_sglangs_op() -> None:
    calls = []
    meta = torch.empty(2, device="meta")
    cpu_inplace_all_reduce(lambda t, name: calls.append((t.device.type, name)), meta, "tp")
    assert calls == [("meta", "tp")]


def test_rows_match_the_installed_sglang() -> None:
    for p in TP_PATCHES:
        assert p.feature == "cpu" and p.kind in ("around", "after")
        check_signature(p)
