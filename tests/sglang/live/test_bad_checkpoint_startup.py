"""On the live CPU server, a bad retriever checkpoint stops sglang's startup with one clear line,
before the model loads (the plugin validates it at registration), and leaves no process behind."""

import pytest

from tests.sglang.live.conftest import FULL_BUDGET, make_server


def test_a_truncated_checkpoint_stops_startup(serving_model, live_logs, tmp_path):
    from flashmemory.serve.cpu_server import ServerError

    bad = tmp_path / "cut.safetensors"
    bad.write_bytes(b'\x10\x00\x00\x00\x00\x00\x00\x00{"a":')  # a safetensors header cut short
    srv = make_server(
        serving_model, live_logs, "bad_ckpt", env={**FULL_BUDGET, "SGLANG_RETRIEVER_INLINE_CKPT": str(bad)}
    )
    try:
        with pytest.raises(ServerError, match="during startup"):
            srv.wait_ready(600)
        log = srv.log.read_text(errors="replace")
        assert "FlashMemory startup error" in log and "cut.safetensors" in log, log[-3000:]
    finally:
        srv.stop()
    assert srv.leftovers() == []
