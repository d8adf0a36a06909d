"""Demo stage 7 (`flashmemory demo --serve`): the retriever the demo just trained, serving in the real sglang server.

P, D (FlashMemory on, shrink mode, Level 1 with the demo's checkpoint) and the router start on this machine through
the launch scripts (DEVICE=cpu); chat requests built from the demo's test documents go through the router with the
`openai` client, and D's live FlashMemory counters (`/metrics`) are read at the end: resident fraction, pages and
bytes recalled, Level-1 cycles. The retriever has to fit the served model, so `--serve` runs the whole demo on the
serving-tiny checkpoint (`checkpoints/tiny-dsv4-sglang`, 2 c4 layers).
"""

from __future__ import annotations

import time
from pathlib import Path

from flashmemory.serve.client import flashmemory_metrics

# what the demo reports from D's /metrics (prometheus names of flashmemory/sglang/metrics.py)
LIVE_COLUMNS = [
    ("flashmemory_resident_fraction", "resident frac", "{:.3f}"),
    ("flashmemory_recall_bytes_total", "recalled KiB", "{:.0f}"),
    ("flashmemory_recall_pages_total", "pages recalled", "{:.0f}"),
    ("flashmemory_level1_cycles_total", "L1 cycles", "{:.0f}"),
]


def chat_prompts(messages: list[list[dict]], max_chars: int) -> list[list[dict]]:
    """The test documents' chats, each message cut to `max_chars` (the served tokenizer is byte-level)."""
    return [[{"role": m["role"], "content": str(m["content"])[-max_chars:]} for m in msgs] for msgs in messages]


def live_table(s: dict) -> str:
    """One markdown row: the live server's requests and FlashMemory counters."""
    m = s["metrics"]
    vals = []
    for key, _, fmt in LIVE_COLUMNS:
        v = m.get(key)
        vals.append("-" if v is None else fmt.format(v / 1024 if key.endswith("bytes_total") else v))
    head = "| live sglang (PD, CPU) | requests | mean latency s | tokens out | " + \
        " | ".join(h for _, h, _ in LIVE_COLUMNS) + " |"
    sep = "|---|" + "|".join("---:" for _ in range(3 + len(LIVE_COLUMNS))) + "|"
    row = (f"| FlashMemory (KMAX {s['kmax']}) | {len(s['requests'])} | "
           f"{sum(r['latency_s'] for r in s['requests']) / max(1, len(s['requests'])):.1f} | "
           f"{sum(r['completion_tokens'] for r in s['requests'])} | " + " | ".join(vals) + " |")
    return "\n".join([head, sep, row])


def run_serve_stage(model: Path, ckpt: Path, targets: tuple[int, ...], messages: list[list[dict]], out: Path,
                    max_tokens: int, kmax: int, log=print) -> dict:
    """Start the PD stack with the demo's retriever, send `messages` as chats, read D's counters, stop everything."""
    import openai

    from flashmemory.serve.procs import Servers
    from flashmemory.serve.stack import PDConfig, start_pd
    decode_env = {"CKPT": str(ckpt), "LAYERS": ",".join(str(t) for t in targets), "KMAX": str(kmax),
                  "LAST_KEEP": "64", "INTERVAL": "16"}
    servers = Servers(out / "serve_logs")
    try:
        log("       starting decode + prefill, then the router (1-3 minutes on 2 cores) ...")
        stack = start_pd(servers, PDConfig(model=model, decode_env=decode_env))
        log(f"       router {stack.router_url} up (startup s: " +
            ", ".join(f"{k} {v:.0f}" for k, v in stack.startup_s.items()) + ")")
        client = openai.OpenAI(base_url=stack.router_url + "/v1", api_key="none", timeout=900)
        reqs = []
        for msgs in chat_prompts(messages, 1500):
            t = time.monotonic()
            r = client.chat.completions.create(model="default", messages=msgs, max_tokens=max_tokens, temperature=0)
            reqs.append({"latency_s": time.monotonic() - t, "prompt_tokens": r.usage.prompt_tokens,
                         "completion_tokens": r.usage.completion_tokens,
                         "text": (r.choices[0].message.content or "")[:80]})
            log(f"       chat: {r.usage.prompt_tokens} prompt + {r.usage.completion_tokens} tokens in "
                f"{reqs[-1]['latency_s']:.1f} s")
        metrics = flashmemory_metrics(stack.decode_url)
    finally:
        servers.stop()
    left = servers.leftovers()
    if left:
        log(f"       warning: server processes still running: {left}")
    return {"startup_s": stack.startup_s, "requests": reqs, "metrics": metrics, "kmax": kmax,
            "retriever": str(ckpt), "target_layers": list(targets)}
