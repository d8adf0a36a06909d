"""Tensor parallelism on CPU (`--device cpu --tp N`): the three places where stock sglang 0.5.23 does not start.

sglang's CPU backend is gloo for both the device and the cpu group (`srt/platforms/cpu.py:108`), and
`GroupCoordinator.all_reduce` / `all_gather` on CPU tensors go through `torch.distributed` over gloo. What stops a
CPU server with tp > 1 on a host with fewer NUMA nodes than ranks:

- thread binding: `numa_utils.init_threads_binding` (utils/numa_utils.py:454), called for every rank with world =
  dp * tp * pp, asserts world <= NUMA nodes unless sglang's SGLANG_CPU_OMP_THREADS_BIND lists one CPU group per
  rank. Here, with that variable unset and more ranks than nodes, the process's CPU affinity is split into one
  contiguous group per rank (ranks share CPUs round robin when there are fewer CPUs than ranks). The variable,
  when set, is sglang's and applies unchanged.
- pynccl: `init_model_parallel_group` (distributed/parallel_state.py:2185) turns pynccl on for every device but
  npu/xpu; a CUDA torch wheel ships libnccl, so it loads, and `pynccl.py:116` then raises on the CPU device. For
  a gloo group pynccl and the custom all-reduce (CUDA IPC buffers) are switched off.
- DSv4's single KV head: `adjust_config_with_unaligned_cpu_tp` (configs/update_config.py:226, called by
  model_runner.py:1302 on CPU) pads KV heads to a multiple of tp when `num_kv_heads % tp != 0`; DeepSeek-V4 is
  MQA (one KV head, replicated on every rank) and its attention asserts exactly one (models/deepseek_v4.py:1060).
  For DSv4 the config stays as it is once its query heads and output groups split evenly over the ranks
  (`o_groups` is split per rank, deepseek_v4.py:1036); otherwise one line names the setting and the server stops.

Attention data parallelism (`--tp N --attn-dp-size M`) needs two more, both at the first forward:
- batch padding: DP attention pads each rank's batch (`ForwardBatch._pad_inputs_to_size`,
  model_executor/forward_batch_info.py:2014) with the seq_len the backend names; on CPU it asks for
  `get_cpu_graph_seq_len_fill_value`, which `DeepseekV4AttnBackend` does not define (its CUDA twin,
  deepseek_v4_backend.py:3382, says 1). Each DSv4 backend instance gets the CPU name bound to the CUDA one, so a
  padded row is the one-token row the CUDA path pads with.
- the token gather: `_dp_gather_via_all_reduce` (layers/dp_attention.py:708) sums the int32 token buffer with the
  custom op `sglang::inplace_all_reduce`, which sglang registers for one device key (CUDA here), so a CPU tensor
  finds no kernel. A CPU tensor is summed in place over the named group's gloo device group instead (what the op's
  body does when no NCCL communicator exists); any other tensor goes to sglang's op.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from flashmemory.sglang.plumbing.patch_spec import Patch

logger = logging.getLogger(f"sglang.{__name__}")  # under "sglang": its log handler prints it
_TP = "flashmemory.sglang.cpu.patches_tp"


def split_cpus(cpus: list[int], world: int, index: int) -> list[int]:
    """CPU ids of rank `index` when `cpus` (sorted) is split into `world` contiguous groups of near-equal size;
    with fewer CPUs than ranks, rank i takes CPU i mod len(cpus). Pure: the same inputs give the same groups."""
    if not cpus or world < 1 or not 0 <= index < world:
        raise ValueError(f"split_cpus: {len(cpus)} CPUs, world {world}, index {index}")
    if len(cpus) < world:
        return [cpus[index % len(cpus)]]
    base, extra = divmod(len(cpus), world)
    start = index * base + min(index, extra)
    return cpus[start : start + base + (index < extra)]


def bind_threads_per_rank(original: Callable, *args: Any, numa_index: int, world_size: int, **kwargs: Any) -> str:
    """AROUND `init_threads_binding`: sglang's binding where it can run; else this rank's share of the affinity."""
    from sglang.srt.utils.common import get_cpu_ids_by_node

    from flashmemory.env import cpu_threads_bind_set

    if cpu_threads_bind_set() or world_size <= len(get_cpu_ids_by_node()):
        return original(*args, numa_index=numa_index, world_size=world_size, **kwargs)
    mine = ",".join(map(str, split_cpus(sorted(os.sched_getaffinity(0)), world_size, numa_index)))
    logger.info(
        "FlashMemory CPU layer: %d ranks on fewer NUMA nodes; rank %d binds CPUs %s", world_size, numa_index, mine
    )
    return mine


def gloo_group_without_nccl(
    original: Callable, group_ranks: Any, local_rank: int, backend: str, *args: Any, **kwargs: Any
) -> Any:
    """AROUND `init_model_parallel_group`: a gloo group gets neither pynccl nor the CUDA custom all-reduce."""
    if backend == "gloo":
        kwargs.update(use_pynccl=False, use_custom_allreduce=False)
    return original(group_ranks, local_rank, backend, *args, **kwargs)


def check_dsv4_tp(hf_config: Any, tp_size: int) -> str | None:
    """Why DeepSeek-V4 cannot split over `tp_size` ranks (attention heads and output groups must divide), or None."""
    heads = int(getattr(hf_config, "num_attention_heads", 0) or 0)
    groups = int(getattr(hf_config, "o_groups", 1) or 1)
    if heads % tp_size or groups % tp_size:
        return (
            f"--tp {tp_size}: DeepSeek-V4's num_attention_heads ({heads}) and o_groups ({groups}) must both be "
            f"divisible by the tensor-parallel size"
        )
    return None


def keep_dsv4_kv_head(
    original: Callable, model_config: Any, load_config: Any, tp_size: int, *args: Any, **kwargs: Any
) -> Any:
    """AROUND `adjust_config_with_unaligned_cpu_tp`: DSv4 keeps its one replicated KV head (no padding)."""
    from sglang.srt.configs.model_config import is_deepseek_v4

    if tp_size <= 1 or not is_deepseek_v4(model_config.hf_config):
        return original(model_config, load_config, tp_size, *args, **kwargs)
    why = check_dsv4_tp(model_config.hf_config, tp_size)
    if why is not None:
        from flashmemory.sglang.plumbing.patching import StartupError

        raise StartupError(why)
    return model_config


def cpu_pad_fill_value(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    """Part of the CPU layer's one AFTER hook on `DeepseekV4AttnBackend.__init__` (`patches_runtime.after_backend_init`;
    sglang's HookRegistry applies a target once): `get_cpu_graph_seq_len_fill_value` (read when DP attention pads a
    batch on CPU, model_executor/forward_batch_info.py:2014) answers the backend's CUDA fill value
    (deepseek_v4_backend.py:3382); a class that defines the CPU name keeps its own."""
    if not hasattr(type(self), "get_cpu_graph_seq_len_fill_value"):
        self.get_cpu_graph_seq_len_fill_value = self.get_cuda_graph_seq_len_fill_value


def cpu_inplace_all_reduce(original: Callable, tensor: Any, group_name: str, *args: Any, **kwargs: Any) -> None:
    """AROUND `sglang::inplace_all_reduce` (`tensor` summed in place over group `group_name`): a CPU tensor is
    reduced by `torch.distributed` over that group's device group (gloo on CPU); others go to sglang's op."""
    if getattr(tensor, "device", None) is None or tensor.device.type != "cpu":
        return original(tensor, group_name, *args, **kwargs)
    import torch.distributed as dist
    from sglang.srt.distributed.parallel_state import _groups

    ref = _groups.get(group_name)
    group = ref() if ref is not None else None
    if group is None:
        raise ValueError(f"inplace_all_reduce: process group {group_name!r} is not registered or was destroyed")
    dist.all_reduce(tensor, group=group.device_group)
    return None


TP_PATCHES: tuple[Patch, ...] = (
    Patch(
        "cpu",
        "sglang.srt.utils.numa_utils.init_threads_binding",
        "around",
        f"{_TP}:bind_threads_per_rank",
        ("numa_index", "world_size"),
        "utils/numa_utils.py:463 asserts ranks <= NUMA nodes without "
        "SGLANG_CPU_OMP_THREADS_BIND; -> one contiguous CPU group of the affinity per rank",
    ),
    Patch(
        "cpu",
        "sglang.srt.distributed.parallel_state.init_model_parallel_group",
        "around",
        f"{_TP}:gloo_group_without_nccl",
        ("group_ranks", "local_rank", "backend"),
        "distributed/parallel_state.py:2185 pynccl on for a gloo group (pynccl.py:116 raises on cpu); custom "
        "all-reduce off too",
    ),
    Patch(
        "cpu",
        "sglang.srt.configs.update_config.adjust_config_with_unaligned_cpu_tp",
        "around",
        f"{_TP}:keep_dsv4_kv_head",
        ("model_config", "load_config", "tp_size"),
        "configs/update_config.py:226 pads DSv4's single KV head to tp (deepseek_v4.py:1060 asserts 1)",
    ),
    Patch(
        "cpu",
        "sglang.srt.distributed.parallel_state.inplace_all_reduce",
        "around",
        f"{_TP}:cpu_inplace_all_reduce",
        ("tensor", "group_name"),
        "layers/dp_attention.py:708 the DP token gather's sglang::inplace_all_reduce has no CPU kernel -> "
        "torch.distributed over the group's gloo device group",
    ),
)
