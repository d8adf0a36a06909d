"""The sglang dump backend: a client for a dump-mode sglang server's OpenAI-compatible API.

Per batch: pass 1 runs the items concurrently (greedy, max_tokens) with a pass-1 `flashmemory_dump`
block (which also asks for the stored native top-k, `cfg.store_topk` / `cfg.topk_interval`); pass 2
sends each item's messages plus the assistant response with max_tokens=2 (the server records in decode
steps; with 1 token the request ends after prefill) and a pass-2 block (no top-k), one at a time; then
the pass-2 keys replace pass 1's (pass 1's labels, logits and top-k stay) and the document is handed
back for commit. The server writes the per-pass files under `<output_dir>/.staging/` (see `protocol.py`).
An interrupted run's per-pass files are cleared at start (`clear_staging`): only files the server wrote
(a `doc_*.safetensors` whose header says it is a flashmemory dump file) and this project's tagged temp
files are deleted; anything else is left, and a doc-named file it cannot verify stops the run.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from flashmemory.dump.backend import DumpBackendError, DumpConfig, DumpItemError
from flashmemory.dump.confine import unusable
from flashmemory.dump.format import FORMAT, DumpDoc, DumpFormatError, load_doc, topk_store_steps
from flashmemory.dump.inputs import InputItem
from flashmemory.dump.metadata import DOC_RE
from flashmemory.dump.outdir import is_own_tmp
from flashmemory.dump.protocol import DumpRequest

STAGING = ".staging"
PASS2_MAX_TOKENS = 2


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": "Bearer EMPTY"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read().decode())


def http_error_message(e: urllib.error.HTTPError, limit: int = 2000) -> str:
    """The server's reason for an HTTP error, on one line: the `message` of sglang's error body
    (`{"object": "error", "message": ...}`, or `{"error": {"message": ...}}`, `{"detail": ...}`), else the body's
    text; whole up to `limit` characters, so a dump refusal keeps its reason after a long output_dir."""
    try:
        raw = e.read().decode("utf-8", errors="replace")
    except OSError:
        raw = ""
    msg: object = raw
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if isinstance(body, dict):
        err = body.get("error")
        msg = body.get("message") or (err.get("message") if isinstance(err, dict) else err) or body.get("detail") or raw
    text = " ".join(str(msg).split()) or (e.reason if isinstance(e.reason, str) else "no reason given")
    return text if len(text) <= limit else text[:limit] + "..."


def clear_staging(staging: Path) -> int:
    """Delete what an interrupted run left in `staging/pass{1,2}/`: per-pass files the server wrote (doc-named,
    with a flashmemory dump header) and this project's tagged temp files. Returns how many. Nothing else is
    deleted; a doc-named file that is not verifiably the server's would be read as this run's output, so it
    is a DumpBackendError naming it (move it away)."""
    from flashmemory.dump.writer import _header_meta

    n = 0
    for sub in (staging / "pass1", staging / "pass2"):
        if sub.is_symlink() or not sub.is_dir():
            if sub.is_symlink() or sub.exists():
                raise DumpBackendError(
                    f"{sub}: not a directory of the staging area (a symlink or a file); move it "
                    "away, the dump server refuses to write through it"
                )
            continue
        for f in sorted(sub.iterdir()):
            plain = f.is_file() and not f.is_symlink()
            if plain and is_own_tmp(f.name):
                f.unlink()
                n += 1
            elif DOC_RE.match(f.name):
                if not (plain and f.suffix == ".safetensors" and _header_meta(f).get("format") == FORMAT):
                    raise DumpBackendError(
                        f"{f}: in the dump staging area, but not a file the dump server wrote "
                        "(never deleted): move it away and rerun"
                    )
                f.unlink()
                n += 1
    return n


def read_compk(path: Path) -> dict[int, torch.Tensor]:
    """The `compk_layer_{L}` tensors of a (pass-2) file, without requiring the rest of a document."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            out = {int(k.rsplit("_", 1)[1]): f.get_tensor(k) for k in f.keys() if k.startswith("compk_layer_")}
    except Exception as e:
        raise DumpFormatError(f"{path}: unreadable safetensors file ({type(e).__name__}: {e}); truncated?") from e
    if not out:
        raise DumpFormatError(f"{path}: no compk_layer_* key")
    return out


def merge_passes(r1: DumpRequest, r2: DumpRequest, rid: str, where: str = "") -> DumpDoc:
    """The committed document: pass 1's file (labels, logits, stored native top-k) with pass 2's
    `compk_layer_*` (prompt + response keys). Raises DumpItemError naming `where` when a file is
    unreadable, the passes disagree, or pass 1 lacks the top-k steps `r1` asked for."""
    try:
        doc = load_doc(r1.doc_path())
        compk = read_compk(r2.doc_path())
    except DumpFormatError as e:
        raise DumpItemError(f"{where}: {e}") from None
    if sorted(compk) != doc.target_layers:
        raise DumpItemError(f"{where}: pass 2 has compk layers {sorted(compk)}, pass 1 {doc.target_layers}")
    want = topk_store_steps(doc.n_tokens, r1.store_topk, r1.topk_interval)
    if not torch.equal(doc.native_topk_steps, want) or (want.numel() and not doc.native_topk):
        raise DumpItemError(
            f"{where}: pass 1 stores native top-k at steps {doc.native_topk_steps.tolist()[:8]} "
            f"(layers {sorted(doc.native_topk)}), but store_topk={r1.store_topk} "
            f"topk_interval={r1.topk_interval} asks for {want.tolist()[:8]} (T={doc.n_tokens})"
        )
    doc.compk = compk
    doc.doc_index, doc.rid = r1.doc_index, rid
    try:
        doc.validate(f"{where} (merged)")
    except DumpFormatError as e:
        raise DumpItemError(str(e)) from None
    return doc


class SGLangBackend:
    name = "sglang"
    n_c4_layers = None  # the server checks the layers against the model it serves

    def __init__(
        self,
        url: str,
        output_dir: Path,
        model: str = "default",
        concurrency: int = 4,
        thinking: bool = False,
        timeout: float = 3600.0,
        flush_timeout: float = 60.0,
    ):
        self.url = url.rstrip("/")
        self.staging = Path(output_dir).resolve() / STAGING
        self.model = model
        self.concurrency = max(1, concurrency)
        self.thinking = thinking
        self.timeout = timeout
        self.flush_timeout = flush_timeout
        self._check_reachable()
        clear_staging(self.staging)  # leftovers of an interrupted run are redone; nothing else is deleted

    def _check_reachable(self) -> None:
        try:
            with urllib.request.urlopen(f"{self.url}/models", timeout=10) as r:
                r.read()
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise DumpBackendError(
                f"cannot reach the sglang server at {self.url} ({reason}); start it with "
                "data_generation/start_dump_server.sh or pass --url"
            ) from None

    def _chat(self, messages: list[dict], max_tokens: int, req: DumpRequest) -> str:
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "custom_params": req.to_custom_params(),
        }
        if self.thinking:
            body["chat_template_kwargs"] = {"thinking": True}
        try:
            out = _post(f"{self.url}/chat/completions", body, self.timeout)
        except urllib.error.HTTPError as e:  # 4xx: this request is bad (too long, ...); 5xx may pass later
            raise DumpItemError(
                f"server answered HTTP {e.code}: {http_error_message(e)}", permanent=400 <= e.code < 500
            ) from None
        except (urllib.error.URLError, OSError) as e:
            raise DumpBackendError(f"lost the sglang server at {self.url} ({getattr(e, 'reason', e)})") from None
        try:
            return out["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise DumpItemError(f"unexpected completion response: {str(out)[:300]}") from None

    def _wait(self, path: Path) -> None:
        """Until the server's file is at `path`; DumpItemError at once (one line naming the component) when the
        directory cannot take it (`confine.unusable`), else after flush_timeout."""
        deadline = time.monotonic() + self.flush_timeout
        while not path.is_file():
            why = unusable(path, self.staging)
            if why:
                raise DumpItemError(f"the server cannot write {path.name}: {why}")
            if time.monotonic() > deadline:
                raise DumpItemError(
                    f"the server did not write {path} within {self.flush_timeout:.0f} s (is it "
                    "running in dump mode, SGLANG_FLASHMEMORY_DUMP=1, with this --output-dir under "
                    "its SGLANG_FLASHMEMORY_DUMP_ROOT? its log names the reason)",
                    permanent=False,
                )
            time.sleep(0.05)

    def _request(self, pass_: int, doc_index: int, cfg: DumpConfig) -> DumpRequest:
        return DumpRequest(
            pass_=pass_,
            doc_index=doc_index,
            output_dir=str(self.staging),
            topp=cfg.topp,
            min_layers=cfg.min_layers,
            target_csa_layers=cfg.target_layers,
            n_logit_tokens=cfg.n_logit_tokens,
            store_topk=cfg.store_topk if pass_ == 1 else "none",
            topk_interval=cfg.topk_interval,
        )

    def _pass1(self, item: InputItem, doc_index: int, cfg: DumpConfig) -> str | DumpItemError:
        try:
            resp = self._chat(item.messages, cfg.max_tokens, self._request(1, doc_index, cfg))
            if not resp:
                raise DumpItemError("empty response")
            return resp
        except DumpItemError as e:
            return DumpItemError(f"{item.where}: pass 1: {e}", permanent=e.permanent)

    def _pass2(self, item: InputItem, doc_index: int, rid: str, response: str, cfg: DumpConfig) -> DumpDoc:
        r1, r2 = self._request(1, doc_index, cfg), self._request(2, doc_index, cfg)
        # max_tokens=2: the server records in decode steps, and with 1 token the request ends after prefill.
        self._chat(item.messages + [{"role": "assistant", "content": response}], PASS2_MAX_TOKENS, r2)
        self._wait(r1.doc_path())
        self._wait(r2.doc_path())
        return merge_passes(r1, r2, rid, item.where)

    def dump_batch(
        self, jobs: list[tuple[InputItem, int, str]], cfg: DumpConfig
    ) -> Iterator[tuple[InputItem, DumpDoc | DumpItemError]]:
        with ThreadPoolExecutor(self.concurrency) as pool:
            responses = list(pool.map(lambda j: self._pass1(j[0], j[1], cfg), jobs))
        for (item, doc_index, rid), resp in zip(jobs, responses):
            if isinstance(resp, DumpItemError):
                yield item, resp
                continue
            try:
                yield item, self._pass2(item, doc_index, rid, resp, cfg)
            except DumpItemError as e:
                yield item, e
            for p in (1, 2):
                self._request(p, doc_index, cfg).doc_path().unlink(missing_ok=True)
