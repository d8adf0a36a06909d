"""Demo stage 7 (`flashmemory demo --serve`, what `make demo` runs): a retriever serving in the real sglang server.

P, D (FlashMemory on, shrink mode, Level 1 with a retriever) and the router start on this machine through the
launch scripts (DEVICE=cpu); chat requests built from the demo's test documents go through the router with the
`openai` client, concurrently, and D's live FlashMemory counters (`/metrics`) are read while they run and at the
end: resident fraction, pages and bytes recalled, Level-1 cycles.

sglang serves only the serving-tiny geometry (head_dim 512, rope 64, index 128, pages of 256 tokens:
`checkpoints/tiny-dsv4-sglang`, random weights, 2 c4 layers), not the trained replay model of stages 1-6, so the
served model is that one and the retriever must fit it: when the demo ran on another model, a retriever is trained
here for the served model from a dump of it on the demo's own training text (`flashmemory.serve.tiny_retriever`);
when the demo itself ran on the served model (`--model checkpoints/tiny-dsv4-sglang`), the demo's checkpoint serves.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

# what the demo reports from D's /metrics (prometheus names of flashmemory/sglang/metrics/prometheus.py)
LIVE_COLUMNS = [
    ("flashmemory_resident_fraction", "resident frac", "{:.3f}"),
    ("flashmemory_recall_bytes_total", "recalled KiB", "{:.0f}"),
    ("flashmemory_recall_pages_total", "pages recalled", "{:.0f}"),
    ("flashmemory_warm_start_pages_total", "of them at admission", "{:.0f}"),
    ("flashmemory_level1_cycles_total", "L1 cycles", "{:.0f}"),
]
# Level-1 cadence and recency tail on D. Short, because the demo's chats decode only a few tokens: every 4 steps,
# and a 16-chunk tail (a quarter page), as the live small-budget test (c) runs it.
SERVE_INTERVAL = 4
SERVE_LAST_KEEP = 16
# python modules the stage needs (pip install -e '.[serve,serve-nixl]'; requirements.txt has them all)
SERVE_MODULES = ("sglang", "sglang_router", "openai", "nixl")


@dataclass(frozen=True)
class ServedRetriever:
    """The checkpoint D loads, the c4 layers it targets, and a line saying which it is and why."""

    ckpt: Path
    layers: tuple[int, ...]
    note: str


def missing_serve_modules(modules: tuple[str, ...] = SERVE_MODULES) -> list[str]:
    """The modules among `modules` that are not installed (checked before the demo's first stage)."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def same_model(demo_model: str | Path, served: Path) -> bool:
    """Whether the demo's model (a name or a dir) is the served checkpoint dir itself."""
    p = Path(demo_model)
    return p.is_dir() and p.resolve() == Path(served).resolve()


def served_token_prompts(served: Path, texts: Sequence[str]) -> list[list[int]]:
    """`texts` as the served model's tokenizer encodes them (no special tokens)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(served))
    return [list(tok.encode(t, add_special_tokens=False)) for t in texts]


def choose_retriever(
    demo_model: str,
    demo_ckpt: Path,
    demo_layers: tuple[int, ...],
    served: Path,
    work: Path,
    train: Callable[[Path, Path], Path] | None = None,
    texts: Sequence[str] = (),
) -> ServedRetriever:
    """The demo's own retriever when the demo ran on the served model; else one trained for the served model by
    `train(served, work / "serve_retriever")`. Default: `train_tiny_retriever` (c4 layers 0 and 1) on `texts`
    (the demo's train/val documents cut like the served chats, so it trains on the text it will score; about a
    minute on a loaded 2-core box), else on random token ids (about half a minute)."""
    if same_model(demo_model, served):
        return ServedRetriever(
            demo_ckpt,
            tuple(demo_layers),
            f"the retriever the demo trained in stage 4 ({demo_ckpt.name}, c4 layers "
            f"{tuple(demo_layers)}): the demo ran on the served model",
        )
    from flashmemory.serve.tiny_retriever import TARGETS, TinyRetrieverConfig, train_tiny_retriever

    tcfg = TinyRetrieverConfig(progress=False)
    on_texts = len(texts) >= tcfg.n_train + tcfg.n_val
    if train is None:

        def train(model: Path, out: Path) -> Path:
            return train_tiny_retriever(model, out, tcfg, served_token_prompts(model, texts) if on_texts else None)

    ckpt = train(served, work / "serve_retriever")
    docs = f"{tcfg.n_train + tcfg.n_val} of the demo's training documents" if on_texts else "random token ids"
    return ServedRetriever(
        Path(ckpt),
        TARGETS,
        f"a retriever trained here for the served model from a dump of it on {docs} "
        f"({Path(ckpt).name}, c4 layers {TARGETS}): stage 4's retriever fits the replay model "
        f"({Path(demo_model).name}, c4 layers {tuple(demo_layers)}), whose geometry sglang "
        "cannot serve",
    )


def chat_prompts(messages: list[list[dict]], max_chars: int) -> list[list[dict]]:
    """The test documents' chats, each message cut to its last `max_chars` characters (the served tokenizer is
    byte-level: about one token a character; the question is at the end)."""
    return [[{"role": m["role"], "content": str(m["content"])[-max_chars:]} for m in msgs] for msgs in messages]


def mean_sample(samples: list[float]) -> float | None:
    """Mean of the positive gauge samples (the gauge reads 0 before the first decode cycle), None if none."""
    pos = [s for s in samples if s > 0]
    return sum(pos) / len(pos) if pos else None


def live_row(s: dict) -> dict[str, float | None]:
    """The live counters to report: D's final /metrics, the resident fraction as the mean over the run's samples."""
    m = dict(s["metrics"])
    if s.get("resident_samples"):
        m["flashmemory_resident_fraction"] = mean_sample(s["resident_samples"])
    return m


def live_table(s: dict) -> str:
    """Markdown: the live server's requests and FlashMemory counters (one row), or the stage's error."""
    if "error" in s:
        return f"Live serving failed: {s['error']}"
    m = live_row(s)
    vals = []
    for key, _, fmt in LIVE_COLUMNS:
        v = m.get(key)
        vals.append("-" if v is None else fmt.format(v / 1024 if key.endswith("bytes_total") else v))
    reqs = s["requests"]
    n = max(1, len(reqs))
    head = (
        "| live sglang (PD, CPU) | requests | mean prompt tokens | mean latency s | tokens out | "
        + " | ".join(h for _, h, _ in LIVE_COLUMNS)
        + " |"
    )
    sep = "|---|" + "|".join("---:" for _ in range(4 + len(LIVE_COLUMNS))) + "|"
    row = (
        f"| FlashMemory (KMAX {s['kmax']} pages) | {len(reqs)} | "
        f"{sum(r.get('prompt_tokens', 0) for r in reqs) / n:.0f} | "
        f"{sum(r['latency_s'] for r in reqs) / n:.1f} | "
        f"{sum(r['completion_tokens'] for r in reqs)} | " + " | ".join(vals) + " |"
    )
    return "\n".join([head, sep, row])


def live_note(s: dict) -> str:
    """The line under the live row: which model and retriever served, and that it is not the replay model."""
    if "error" in s:
        return ""
    return (
        f"Served model: `{Path(s['model']).name}`, the serving-tiny DeepSeek-V4 (random weights, the geometry "
        "sglang accepts), not the replay model of the tables above, so its text is noise and its numbers are "
        f"mechanics, not quality. Retriever: {s['retriever_note']}. Pages of 64 chunks (256 tokens); recency "
        f"tail {s.get('last_keep', SERVE_LAST_KEEP)} chunks; Level 1 every {s.get('interval', SERVE_INTERVAL)} "
        "decode steps; `of them at admission`: pages recalled when a request entered D (its warm start), the rest "
        "by Level-1 cycles; resident frac: mean of D's gauge sampled while requests ran."
    )


def read_metrics(
    url: str,
    tries: int = 3,
    timeout: float = 30.0,
    wait: float = 5.0,
    get: Callable[..., tuple[int, bytes]] | None = None,
) -> dict[str, float]:
    """D's flashmemory_* samples; a server busy with a long CPU forward may not answer within one timeout (once
    measured: 10 s), so it is asked `tries` times, `wait` s apart. Raises RuntimeError when it never answers."""
    from flashmemory.serve.client import parse_metrics
    from flashmemory.serve.procs import http_get

    status = 0
    for i in range(tries):
        status, body = (get or http_get)(url + "/metrics", timeout=timeout)
        if status == 200:
            return parse_metrics(body.decode(errors="replace"))
        if i + 1 < tries:
            time.sleep(wait)
    raise RuntimeError(f"{url}/metrics answered {status or 'nothing'} {tries} times in a row")


def _chat(client, msgs: list[dict], max_tokens: int) -> dict:
    t = time.monotonic()
    # ignore_eos (sglang's extension): the random-weight model may emit EOS at once; the stage wants the decode steps
    r = client.chat.completions.create(
        model="default", messages=msgs, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
    )
    return {
        "latency_s": time.monotonic() - t,
        "prompt_tokens": r.usage.prompt_tokens,
        "completion_tokens": r.usage.completion_tokens,
        "text": (r.choices[0].message.content or "")[:80],
    }


def run_serve_stage(
    model: Path,
    retriever: ServedRetriever,
    messages: list[list[dict]],
    out: Path,
    max_tokens: int,
    kmax: int,
    prompt_chars: int,
    log=print,
) -> dict:
    """Start the PD stack with `retriever` on D, send `messages` as concurrent chats through the router, sample
    D's counters while they run, read them at the end, stop every server. Returns the stage's results."""
    import openai

    from flashmemory.serve.procs import Servers
    from flashmemory.serve.stack import PDConfig, start_pd

    decode_env = {
        "CKPT": str(retriever.ckpt),
        "LAYERS": ",".join(str(t) for t in retriever.layers),
        "KMAX": str(kmax),
        "LAST_KEEP": str(SERVE_LAST_KEEP),
        "INTERVAL": str(SERVE_INTERVAL),
    }
    servers = Servers(out / "serve_logs")
    samples: list[float] = []
    try:
        log("       starting decode + prefill, then the router (2-5 minutes on 2 shared cores) ...")
        stack = start_pd(servers, PDConfig(model=model, decode_env=decode_env))
        log(
            f"       router {stack.router_url} up (startup s: "
            + ", ".join(f"{k} {v:.0f}" for k, v in stack.startup_s.items())
            + ")"
        )
        client = openai.OpenAI(base_url=stack.router_url + "/v1", api_key="none", timeout=1800, max_retries=0)
        prompts = chat_prompts(messages, prompt_chars)
        log(f"       {len(prompts)} concurrent chats of about {prompt_chars} tokens + {max_tokens} ...")
        t0 = time.monotonic()
        with ThreadPoolExecutor(len(prompts)) as ex:
            futs = [ex.submit(_chat, client, msgs, max_tokens) for msgs in prompts]
            while not all(f.done() for f in futs):
                try:  # one try: a sample a busy server does not answer in time is skipped
                    m = read_metrics(stack.decode_url, tries=1, timeout=10.0)
                    samples.append(m.get("flashmemory_resident_fraction", 0.0))
                except RuntimeError:
                    pass
                time.sleep(1.0)  # every second: a chat of 16 tokens decodes in a few seconds on CPU
            reqs = [f.result() for f in futs]
        for r in reqs:
            log(f"       chat: {r['prompt_tokens']} prompt + {r['completion_tokens']} tokens in {r['latency_s']:.1f} s")
        wall = time.monotonic() - t0
        metrics = read_metrics(stack.decode_url)
    finally:
        servers.stop()
    left = servers.leftovers()
    if left:
        log(f"       warning: server processes still running: {left}")
    return {
        "model": str(model),
        "startup_s": stack.startup_s,
        "requests": reqs,
        "requests_wall_s": wall,
        "metrics": metrics,
        "resident_samples": samples,
        "kmax": kmax,
        "interval": SERVE_INTERVAL,
        "last_keep": SERVE_LAST_KEEP,
        "retriever": str(retriever.ckpt),
        "target_layers": list(retriever.layers),
        "retriever_note": retriever.note,
    }


def check_serve_modules() -> None:
    """Before stage 1: raise a `UserError` naming what `--serve` is missing (so a long run does not fail at 7)."""
    from flashmemory.errors import UserError

    missing = missing_serve_modules()
    if missing:
        raise UserError(
            f"--serve needs the python packages {', '.join(missing)}, which are not installed: "
            "pip install -e '.[serve,serve-nixl]' (or pass --no-serve)"
        )


def chat_text(messages: list[dict], max_chars: int) -> str:
    """A chat's text as a retriever training document: its messages' contents joined, the last `max_chars`."""
    return "\n".join(str(m["content"]) for m in messages)[-max_chars:]


def serve_demo(
    demo_model: str,
    demo_ckpt: Path,
    demo_layers: tuple[int, ...],
    messages: list[list[dict]],
    out: Path,
    max_tokens: int,
    kmax: int,
    prompt_chars: int,
    log=print,
    train_messages: list[list[dict]] = (),
) -> dict:
    """Stage 7 as the demo runs it: pick the served model and its retriever (trained on `train_messages` when the
    demo's own does not fit), serve `messages`. A server that does not start or a request that fails is returned
    as {"error": line} (the stages before it still get reported)."""
    import openai

    from flashmemory.serve.procs import ServerStartError
    from flashmemory.serve.stack import DEFAULT_CPU_MODEL, ensure_model

    try:
        t = time.monotonic()
        served = Path(demo_model) if same_model(demo_model, DEFAULT_CPU_MODEL) else ensure_model(DEFAULT_CPU_MODEL)
        retriever = choose_retriever(
            demo_model,
            demo_ckpt,
            demo_layers,
            served,
            out / "work",
            texts=[chat_text(m, prompt_chars) for m in train_messages],
        )
        log(f"       served model {served}; retriever: {retriever.note} ({time.monotonic() - t:.0f} s)")
        return run_serve_stage(served, retriever, messages, out, max_tokens, kmax, prompt_chars, log=log)
    except (ServerStartError, openai.OpenAIError, RuntimeError, OSError) as e:
        line = " ".join(str(e).strip().splitlines()[-3:]) or type(e).__name__
        log(f"[demo] error: live serving failed: {line} (server logs: {out / 'serve_logs'})")
        return {"error": f"{line} (server logs: {out / 'serve_logs'})"}
