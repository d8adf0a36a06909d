"""One arm's live stack: P + D + router on 127.0.0.1 through `flashmemory serve`'s `start_pd`, started and held under
the shared live lock, asked with the OpenAI client, its decode server's /metrics read between documents.

The lock (`fcntl.flock` on `lock_path`, the lock `flock(1)` takes too) is held from before the servers start until
they are stopped, so two live stacks never share the 2-core machine; `LiveSession.held_s` lets the run hand it back
after a while (a later stack takes it again).

Requests: `/v1/completions` with a text prompt (sglang-router 0.3.2 refuses token-id prompts), greedy, exactly
`max_tokens` tokens (`ignore_eos`), `return_token_ids` (the prompt's and the output's ids come back) and
`skip_special_tokens: false`; the caller decodes the ids with the task tokenizer.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from flashmemory.eval.live.arms import LiveArm

ROUTER_MODEL = "default"  # the served model's name sglang answers to when none is configured


@dataclass(frozen=True)
class StackSettings:
    """What every arm's stack shares: the served model, the Level-1 retriever (FlashMemory and the prefetch hint),
    extra environment for both servers (e.g. the tiny model's window row), the context length, Level 1's knobs."""

    model: Path
    retriever: str
    server_env: Mapping[str, str] = field(default_factory=dict)
    context_len: int = 8192
    doc_len: int = 4096
    index_topk: int = 512
    tau: int = 16
    threshold: float = 0.5
    tail_chunks: int = 8
    retriever_layers: tuple[int, ...] = ()  # the c4 layers Level 1 reads (the retriever's); () = the script's
    c4_mode: str = "copy"  # FlashMemory's Path-P mode on D (`arms.C4_MODES`)
    startup_timeout: float = 420.0
    logs: Path = Path("live_logs")


def pd_config(arm: LiveArm, st: StackSettings):
    """The `serve.stack.PDConfig` that starts `arm` (pure)."""
    from flashmemory.serve.stack import PDConfig, hisparse_config

    both = {"CTX_LEN": str(st.context_len), "TGT_CTX": str(st.context_len), **dict(st.server_env)}
    level1 = {
        "CKPT": st.retriever,
        "INTERVAL": str(st.tau),
        "THRESH": f"{st.threshold:g}",
        "LAST_KEEP": str(st.tail_chunks),
    }
    if st.retriever_layers:
        level1["LAYERS"] = ",".join(map(str, st.retriever_layers))
    base = PDConfig(
        model=st.model,
        flashmemory=arm.kind == "FlashMemory",
        decode_env={**both, "CKPT": ""},
        prefill_env=dict(both),
        startup_timeout=st.startup_timeout,
    )
    if arm.kind == "stock":
        return base
    kmax = {"KMAX": str(arm.kmax(st.doc_len))}
    if arm.kind == "FlashMemory":
        shrink = {"C4_SHRINK": "1" if st.c4_mode == "shrink" else "0"}
        return replace(base, decode_env={**base.decode_env, **level1, **kmax, **shrink})
    cfg = hisparse_config(base, arm.hot_slots(st.doc_len, st.index_topk), st.index_topk)
    if arm.kind == "HiSparse+prefetch":
        cfg = replace(
            cfg,
            decode_env={
                **cfg.decode_env,
                **level1,
                **kmax,
                "SGLANG_PLUGINS": "flashmemory_cpu,flashmemory",
                "SGLANG_FLASHMEMORY_HISPARSE_PREFETCH": "1",
            },
        )
    return cfg


class LiveLock:
    """The shared live-server lock, blocking: `with LiveLock(path):` holds it (waiting, with one line, when busy)."""

    def __init__(self, path: str | os.PathLike, log=print):
        self.path, self.log, self.fd = Path(path) if str(path) else Path(""), log, None

    def __enter__(self) -> LiveLock:
        if not str(self.path) or str(self.path) == ".":  # --lock '': the caller holds the lock (or wants none)
            return self
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.log(f"[live] waiting for the live-server lock {self.path} (another live stack or test holds it) ...")
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


@dataclass
class Completion:
    """One request's answer: the prompt's ids as the server tokenized them and the generated ids."""

    prompt_ids: list[int]
    output_ids: list[int]
    text: str


def complete(router_url: str, prompt: str, max_tokens: int, timeout: float = 1800.0) -> Completion:
    """A greedy `/v1/completions` request through the OpenAI client, exactly `max_tokens` tokens, ids returned."""
    from openai import OpenAI

    client = OpenAI(base_url=router_url + "/v1", api_key="none", timeout=timeout, max_retries=0)
    r = client.completions.create(
        model=ROUTER_MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True, "skip_special_tokens": False},
    )
    choice = r.choices[0].model_dump()
    out, prompt_ids = choice.get("token_ids"), choice.get("prompt_token_ids")
    if not isinstance(out, list) or not isinstance(prompt_ids, list):
        raise RuntimeError(f"{router_url}/v1/completions returned no token_ids / prompt_token_ids: {str(choice)[:300]}")
    return Completion([int(t) for t in prompt_ids], [int(t) for t in out], str(choice.get("text", "")))


def read_metrics(decode_url: str) -> dict[str, float]:
    """Every flashmemory_* sample of D's /metrics (FlashMemory's counters and gauges, HiSparse's swap-in and
    prefetch counters), labels summed."""
    from flashmemory.serve.client import flashmemory_metrics

    return flashmemory_metrics(decode_url)


class LiveSession:
    """A started arm: `complete(prompt, n)`, `metrics()`, `held_s()`; `close()` stops the servers, then frees the
    lock. Use `open_session` to make one."""

    def __init__(self, arm: LiveArm, st: StackSettings, lock_path: str, log=print):
        from flashmemory.serve.procs import Servers
        from flashmemory.serve.stack import start_pd

        self.arm, self.log = arm, log
        self.lock = LiveLock(lock_path, log).__enter__()
        self.t0 = time.monotonic()
        self.servers = Servers(st.logs / arm.key)
        try:
            log(f"[live] starting {arm.key}: decode + prefill, then the router (30-70 s on 2 cores) ...")
            self.stack = start_pd(self.servers, pd_config(arm, st), router_port=None)
        except BaseException:
            self.close()
            raise
        log(f"[live] {arm.key} up in {sum(self.stack.startup_s.values()):.0f} s (logs {st.logs / arm.key})")

    def complete(self, prompt: str, max_tokens: int) -> Completion:
        return complete(self.stack.router_url, prompt, max_tokens)

    def metrics(self, settle_s: float = 10.0) -> dict[str, float]:
        """D's flashmemory_* samples once no request is live on it (FlashMemory publishes a finished request's
        last counters when it leaves; up to `settle_s` seconds), else as they are."""
        deadline = time.monotonic() + settle_s
        m = read_metrics(self.stack.decode_url)
        while m.get("flashmemory_live_requests", 0.0) > 0 and time.monotonic() < deadline:
            time.sleep(0.5)
            m = read_metrics(self.stack.decode_url)
        return m

    def held_s(self) -> float:
        return time.monotonic() - self.t0

    def close(self) -> None:
        try:
            self.servers.stop()
            left = self.servers.leftovers()
            if left:
                self.log(f"[live] warning: server processes still running after stop: {left}")
        finally:
            self.lock.__exit__()


def open_session(arm: LiveArm, st: StackSettings, lock_path: str, log=print) -> LiveSession:
    """Take the live lock and start `arm`'s stack (ServerStartError with the log tail if it does not come up)."""
    return LiveSession(arm, st, lock_path, log)
