"""One-H200 smoke check of the FlashMemory sglang plugin on a tiny dummy-weight DeepSeek-V4 (see gpu_check.sh).

Cases run as separate processes (the gates are read once per process by the plugin), in this order:
  stock      no FlashMemory entry point loaded (SGLANG_PLUGINS=none)      greedy tokens = reference
  full       gates on, KMAX covers the whole context (100% residency)      tokens == stock, hooks in the CUDA graph
  r10        gates on, KMAX = 10% of the context pages, 500 decode steps at batch 1, 8, 64
  ret10      r10 with a retriever (random weights, loaded on the CPU at registration as the server does):
             Level 1 scores on the GPU; speed vs stock, tokens reported (10% budget: not expected equal)
  off        plugin loaded, every gate off                                 tokens == stock
Optional with two or more GPUs (GPU_CHECK_CASES=tp2stock,tp2full,tp2ret10): the same at tensor parallelism 2:
  tp2stock   stock at TP 2                                                 greedy tokens = the TP-2 reference
  tp2full    full residency with a retriever cycling Level 1               tokens == tp2stock; both ranks agree
  tp2ret10   ret10 at TP 2                                                 both ranks publish the same plans
             (rank 1's diagnostics are <stats>.rank1: Level-1 cycles, recalled pages and bytes must be equal)
Optional (GPU_CHECK_CASES=dstock,dshrink, ~4 min more): a lone PD decode server with sglang's `fake` transfer
backend (nothing is transferred; both cases decode from the same zeroed KV), which puts Path-P in shrink mode:
  dstock     decode server, no FlashMemory                                 greedy tokens = reference
  dshrink    decode server, shrink mode, full residency                    tokens == dstock, device bytes saved
Writes everything under $OUT (or a temp dir): case_<name>.log (the case's whole output), results.json,
summary.txt (the table). Stops early when `stock` fails: the tiny config or the machine is then the problem,
and the other cases would fail the same way. Installs nothing; if the `flashmemory` entry point is not
installed, a throw-away .dist-info on PYTHONPATH declares it (importlib.metadata finds it there).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/: gpu_check_cases
from gpu_check_cases import (  # noqa: E402
    BATCHES,
    CASES,
    DECODE_STEPS,
    PD_CASES,
    PROMPT_LEN,
    REF_OF,
    TOKEN_CHECK,
    TP_CASES,
    case_env,
    check_case,
    engine_kwargs,
    tiny_config,
    write_retriever,
)

BUDGET_S, FIRST_CASE_S = 455, 200  # whole run (gpu_check.sh kills at 480); the first case pays the JIT builds
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_case(case: str, model_dir: str, out: str, port: int) -> None:
    import sglang as sgl

    t0 = time.perf_counter()
    eng = sgl.Engine(**engine_kwargs(model_dir, port, pd=case in PD_CASES, tp=2 if case in TP_CASES else 1))
    from flashmemory.sglang import plugin

    res: dict = {
        "case": case,
        "startup_s": time.perf_counter() - t0,
        "plugin_state": plugin.state(),
        "tokens": None,
        "tok_s": {},
    }
    print(f"gpu_check[{case}]: engine up in {res['startup_s']:.1f}s, plugin {plugin.state()}", flush=True)
    try:
        prompt = [[(7 * i + 3 * b) % 4000 + 10 for i in range(PROMPT_LEN)] for b in range(max(BATCHES))]
        sp = {"temperature": 0.0, "max_new_tokens": TOKEN_CHECK, "ignore_eos": True}
        res["tokens"] = [o["output_ids"] for o in eng.generate(input_ids=prompt[:2], sampling_params=sp)]
        again = [o["output_ids"] for o in eng.generate(input_ids=prompt[:2], sampling_params=sp)]
        res["deterministic"] = again == res["tokens"]  # if False, a token mismatch below is noise, not FlashMemory
        for bs in BATCHES:
            sp = {"temperature": 0.0, "max_new_tokens": DECODE_STEPS, "ignore_eos": True}
            t = time.perf_counter()
            outs = eng.generate(input_ids=prompt[:bs], sampling_params=sp)
            dt = time.perf_counter() - t
            res["tok_s"][str(bs)] = sum(len(o["output_ids"]) for o in outs) / dt  # prefill included
            print(f"gpu_check[{case}]: bs {bs}: {res['tok_s'][str(bs)]:.0f} tok/s", flush=True)
    finally:
        eng.shutdown()
    with open(out, "w") as f:
        json.dump(res, f)


def run_group(cmd: list[str], env: dict, timeout: int, log: str) -> int | str:
    """Run a case in its own process group and kill the whole group (sglang's scheduler and detokenizer
    processes too) on timeout, or when this script is terminated, so no engine outlives the check."""
    with open(log, "w") as lf:
        p = subprocess.Popen(cmd, env=env, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True)

        def kill(*_: object) -> None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        old = signal.signal(signal.SIGTERM, lambda *a: (kill(), sys.exit(143)))
        try:
            return p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return "timeout"
        finally:
            kill()  # stray children of a finished case too
            p.wait()
            signal.signal(signal.SIGTERM, old)


def ensure_entry_point(work: str) -> str:
    """'' if the entry point is installed, else the PYTHONPATH dir of a throw-away dist-info declaring it."""
    from importlib.metadata import entry_points

    if any(ep.name == "flashmemory" for ep in entry_points(group="sglang.srt.plugins")):
        return ""
    d = os.path.join(work, "ep", "flashmemory_gpu_check-0.0.dist-info")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: flashmemory-gpu-check\nVersion: 0.0\n")
    with open(os.path.join(d, "entry_points.txt"), "w") as f:
        f.write("[sglang.srt.plugins]\nflashmemory = flashmemory.sglang.plugin:register\n")
    return os.path.dirname(d)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dry-run", action="store_true", help="print the plan, touch no GPU")
    ap.add_argument("--case", choices=CASES + PD_CASES + TP_CASES, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=30000, help=argparse.SUPPRESS)
    ap.add_argument("--case-timeout", type=int, default=110, help="seconds per case after the first")
    a = ap.parse_args()
    cases = tuple(x for x in os.environ.get("GPU_CHECK_CASES", ",".join(CASES)).split(",") if x)
    unknown = [x for x in cases if x not in CASES + PD_CASES + TP_CASES]
    if unknown:
        print(
            f"gpu_check: unknown case(s) {unknown} in GPU_CHECK_CASES; known: {', '.join(CASES + PD_CASES + TP_CASES)}",
            file=sys.stderr,
        )
        return 2
    if a.case:
        run_case(a.case, a.model_dir, a.out, a.port)
        return 0
    if a.dry_run:
        for c in cases:
            print(f"case {c}: env {case_env(c)}")
        print(f"engine: {engine_kwargs('<tmp>', 30000)}")
        if any(c in PD_CASES for c in cases):
            print(f"engine (PD cases): {engine_kwargs('<tmp>', 30000, pd=True)}")
        if any(c in TP_CASES for c in cases):
            print(f"engine (TP cases): {engine_kwargs('<tmp>', 30000, tp=2)}")
        print(f"config: {json.dumps(tiny_config())[:120]}...")
        return 0
    start = time.monotonic()
    work = tempfile.mkdtemp(prefix="fm_gpu_check_")
    out_dir = os.environ.get("OUT") or work
    os.makedirs(out_dir, exist_ok=True)
    summary: list[str] = []

    def say(msg: str) -> None:
        print(msg, flush=True)
        summary.append(msg)
        with open(os.path.join(out_dir, "summary.txt"), "w") as f:
            f.write("\n".join(summary) + "\n")

    import torch

    if not torch.cuda.is_available():
        say("gpu_check: FAILED: no CUDA device (use --dry-run on a CPU machine)")
        return 2
    try:
        import sglang  # noqa: F401
    except Exception as e:  # a missing or broken install is the answer, not a traceback per case
        say(f"gpu_check: FAILED: sglang does not import with {sys.executable}: {type(e).__name__}: {e}")
        return 2
    ep_dir = ensure_entry_point(work)
    say(
        f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, sglang {sglang.__version__}, "
        f"python {sys.executable}; entry point {'declared on PYTHONPATH' if ep_dir else 'installed'}; out {out_dir}"
    )
    model_dir = os.path.join(work, "model")
    os.makedirs(model_dir)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(tiny_config(), f)
    results, failures = {}, []
    if any(c in TP_CASES for c in cases) and torch.cuda.device_count() < 2:
        failures.append(f"tp2 cases: skipped, {torch.cuda.device_count()} GPU(s) visible, 2 needed")
        cases = tuple(c for c in cases if c not in TP_CASES)
    for i, c in enumerate(cases):
        left = BUDGET_S - (time.monotonic() - start)
        limit = int(min(left, FIRST_CASE_S if i == 0 else a.case_timeout))
        if limit < 30:
            failures.append(f"{c}: skipped, {left:.0f}s left of the {BUDGET_S}s budget")
            continue
        out, stats = os.path.join(work, f"{c}.json"), os.path.join(work, f"{c}.diag.json")
        pp = os.pathsep.join(x for x in (ep_dir, ROOT, os.environ.get("PYTHONPATH", "")) if x)
        with_ret = c in ("ret10", "tp2full", "tp2ret10")
        ckpt = write_retriever(os.path.join(work, "retriever.safetensors"), tiny_config()) if with_ret else ""
        env = {**os.environ, **case_env(c, stats, ckpt), "PYTHONPATH": pp}
        log = os.path.join(out_dir, f"case_{c}.log")
        t = time.monotonic()
        rc = run_group(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--case",
                c,
                "--model-dir",
                model_dir,
                "--out",
                out,
                "--port",
                str(30000 + 100 * i),
            ],
            env,
            limit,
            log,
        )
        dt = time.monotonic() - t
        if rc != 0 or not os.path.exists(out):
            with open(log, errors="replace") as lf:
                tail = lf.read()[-2500:]
            failures.append(f"{c}: exit {rc} after {dt:.0f}s (limit {limit}s); log {log}; tail:\n{tail}")
            say(f"case {c}: FAILED ({rc}, {dt:.0f}s)")
            if c == "stock":
                break
            continue
        r = json.load(open(out))
        r["wall_s"] = dt
        if os.path.exists(stats):
            r["diag"] = json.load(open(stats))
        if os.path.exists(stats + ".rank1"):
            r["diag_rank1"] = json.load(open(stats + ".rank1"))
        results[c] = r
        say(f"case {c}: ran in {dt:.0f}s (engine start {r['startup_s']:.0f}s)")
    for c, r in results.items():
        failures += check_case(c, r, results.get(REF_OF.get(c, "stock"), {}).get("tokens"))
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"results": results, "failures": failures}, f, indent=1, default=str)

    def base_of(c: str) -> dict:
        names = ("dstock",) if c in PD_CASES else ("tp2stock",) if c in TP_CASES else ("off", "stock")
        return next((results[n]["tok_s"] for n in names if n in results), {})

    say(
        f"{'case':7} "
        + " ".join(f"{'bs' + str(b) + ' x base':>14}" for b in BATCHES)
        + "  tokens==ref  graph(capt/eager)  recall_bytes  resident  saved_GiB   (base: off/stock; dstock for dshrink)"
    )
    for c, r in results.items():
        base = base_of(c)
        rel = " ".join(f"{r['tok_s'].get(str(b), 0) / max(base.get(str(b), 1e-9), 1e-9):14.2f}" for b in BATCHES)
        d = r.get("diag", {})
        graph = f"{d.get('indexer_calls_captured', '-')}/{d.get('indexer_calls_eager', '-')}"
        same = r["tokens"] == results.get(REF_OF.get(c, "stock"), {}).get("tokens")
        say(
            f"{c:7} {rel}  {str(same):>11}  {graph:>17}  {d.get('recall_bytes', 0):12.0f}  "
            f"{d.get('resident_fraction', float('nan')):8.3f}  {d.get('device_bytes_saved', 0) / 2**30:9.2f}"
        )
    for msg in failures:
        say("FAIL " + msg)
    say("gpu_check: " + ("FAILED" if failures else "OK") + f" in {time.monotonic() - start:.0f}s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
