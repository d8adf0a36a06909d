"""Small HTTP clients for a running sglang server or router: /generate (plain and streamed) and /metrics.

Token ids in, token ids out (sglang's native `/generate`), so runs can be compared token for token; the OpenAI
chat path is what users call and is exercised with the `openai` client in the tests and the demo.
"""

from __future__ import annotations

import json
import math
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from flashmemory.serve.procs import http_get, http_post_json


def greedy_params(max_new_tokens: int) -> dict:
    """Greedy decoding of exactly `max_new_tokens` tokens (EOS ignored), so runs are comparable."""
    return {"max_new_tokens": int(max_new_tokens), "temperature": 0.0, "ignore_eos": True}


def generate(url: str, input_ids: list[int], max_new_tokens: int, timeout: float = 900.0) -> list[int]:
    """Output token ids of one greedy request to `url`/generate."""
    out = http_post_json(
        url + "/generate",
        {"input_ids": list(map(int, input_ids)), "sampling_params": greedy_params(max_new_tokens)},
        timeout=timeout,
    )
    ids = out.get("output_ids")
    if not isinstance(ids, list):
        raise RuntimeError(f"{url}/generate returned no output_ids: {str(out)[:300]}")
    return [int(t) for t in ids]


@dataclass
class StreamResult:
    """One streamed request: when it was sent, when each new token arrived (seconds, monotonic) and how many."""

    sent: float
    token_times: list[float]
    n_tokens: int

    @property
    def first(self) -> float:
        return self.token_times[0]

    @property
    def last(self) -> float:
        return self.token_times[-1]


def generate_stream(
    url: str,
    input_ids: list[int],
    max_new_tokens: int,
    timeout: float = 1800.0,
    stop: Callable[[list[float]], bool] | None = None,
) -> StreamResult:
    """A streamed greedy /generate: the arrival time of every chunk that brought new tokens. stop(token_times), if
    given, is asked after each new chunk; True closes the stream early (the server aborts the request)."""
    body = json.dumps(
        {"input_ids": list(map(int, input_ids)), "sampling_params": greedy_params(max_new_tokens), "stream": True}
    ).encode()
    req = urllib.request.Request(url + "/generate", data=body, headers={"Content-Type": "application/json"})
    sent = time.monotonic()
    times: list[float] = []
    n = 0
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            msg = json.loads(data)
            done = int((msg.get("meta_info") or {}).get("completion_tokens", n))
            if done > n:
                now = time.monotonic()
                times.extend([now] * (done - n))
                n = done
                if stop is not None and stop(times):
                    break
    if n == 0:
        raise RuntimeError(f"{url}/generate streamed no tokens")
    return StreamResult(sent, times, n)


def parse_metrics(text: str, prefix: str = "flashmemory_") -> dict[str, float]:
    """Prometheus text -> {name: value} for samples whose name starts with `prefix` (labels summed)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            v = float(value)
        except ValueError:
            continue
        if math.isfinite(v):
            out[name] = out.get(name, 0.0) + v
    return out


def flashmemory_metrics(server_url: str) -> dict[str, float]:
    """The flashmemory_* samples of `server_url`/metrics ({} when the server has none)."""
    status, body = http_get(server_url + "/metrics", timeout=10.0)
    if status != 200:
        raise RuntimeError(f"{server_url}/metrics answered {status}")
    return parse_metrics(body.decode(errors="replace"))
