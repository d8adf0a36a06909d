"""`CpuServer.stop` removes the TP message-queue segments its own stopped processes left, and nothing else."""

from pathlib import Path

from flashmemory.serve.cpu_server import remove_shm_queues


def test_only_the_stopped_processes_queues_go(tmp_path: Path) -> None:
    for name in ("sgl_shm_mq_4242_ab12", "sgl_shm_mq_4242_cd34", "sgl_shm_mq_42421_ef56", "sglang_loads_4242.shm"):
        (tmp_path / name).write_bytes(b"x")
    gone = remove_shm_queues({4242}, shm_dir=tmp_path)
    assert sorted(gone) == ["sgl_shm_mq_4242_ab12", "sgl_shm_mq_4242_cd34"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sgl_shm_mq_42421_ef56", "sglang_loads_4242.shm"]
