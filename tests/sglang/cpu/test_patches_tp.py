"""`--tp N` on CPU: the thread groups, the gloo groups without NCCL, DSv4's single KV head (`cpu/patches_tp.py`)."""

from __future__ import annotations

import os
import types

import pytest

from flashmemory.sglang.cpu.patches_tp import (
    TP_PATCHES,
    bind_threads_per_rank,
    check_dsv4_tp,
    gloo_group_without_nccl,
    keep_dsv4_kv_head,
    split_cpus,
)
from flashmemory.sglang.patch_spec import check_signature

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


def test_rows_match_the_installed_sglang() -> None:
    for p in TP_PATCHES:
        assert p.feature == "cpu" and p.kind == "around"
        check_signature(p)
