"""What a frontier run's documents depend on, by content: the settings a record carries and its fingerprint.

`settings(fc)` is every setting that changes a document's numbers (not out_dir or n_per_task), with the model and
the retriever named by the sha256 of their bytes (`model_digest`, `eval.records.file_digest`): a model renamed or
moved is the same model, another model under the same name is not. It also holds the Level-1 selection defaults
and the harness's monitor settings, so a change of a default policy changes the fingerprint. Each record stores
its settings: `--compare` names the first setting two runs differ in (`settings_diff`).

Records written before settings were stored carry only a fingerprint that named the model by its directory name
(`legacy_fingerprint`): a run still reads them when that fingerprint is its own with the shipped model (the name
"shipped" meant exactly that model), so committed runs stay readable.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict
from pathlib import Path

from flashmemory.errors import UserError
from flashmemory.eval.records import check_tasks, file_digest

SHIPPED = "shipped"
TRAINED_TASKS = ("niah_single", "niah_multikey", "mqar")  # the shipped model's tasks (`eval quality`'s too)
LEGACY_FIELDS = (  # the FrontierConfig fields the legacy fingerprint hashed, besides model and retriever
    "budgets",
    "methods",
    "tasks",
    "doc_len",
    "gen_tokens",
    "tau",
    "page_chunks",
    "tail_chunks",
    "threshold",
    "topp",
    "min_layers",
    "first_doc",
    "seed",
)
WEIGHT_SUFFIXES = (".safetensors", ".bin")  # a checkpoint dir's weights; config.json and *.index.json beside them
# Settings a --compare run may differ in: they choose which methods run and which documents, not how one decodes.
COMPARE_FREE = ("methods", "first_doc")
FLAGS = ("tasks", "doc_len", "gen_tokens", "tau", "page_chunks", "tail_chunks", "threshold", "seed")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def model_digest(model: str, flag: str = "--model") -> str:
    """The model's identity by content: "dir:<sha256>" over a checkpoint dir's config and weight files (name +
    bytes), "random:<sha256>" over a shipped config's or a .json config's JSON (its weights are seeded); "" = the
    shipped trained model's dir. UserError naming `flag` when it is none of these."""
    from flashmemory.hf.models import config_dict, shipped_configs
    from flashmemory.tiny.shipped import trained_model_available, trained_model_dir

    if not model:
        if not trained_model_available():
            return f"{SHIPPED}:missing"
        model = str(trained_model_dir())
    if model in shipped_configs():
        return "random:" + _sha(json.dumps(config_dict(model), sort_keys=True).encode())
    p = Path(model)
    if p.is_file() and p.suffix == ".json":
        try:
            raw = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise UserError(f"{flag} {model}: cannot be read as a JSON config ({e})") from None
        return "random:" + _sha(json.dumps(raw, sort_keys=True).encode())
    if p.is_dir():
        files = sorted(
            f
            for f in p.iterdir()
            if f.is_file() and (f.name.endswith(WEIGHT_SUFFIXES) or f.name.endswith(".index.json"))
        )
        if not (p / "config.json").is_file() or not files:
            raise UserError(f"{flag} {model}: a checkpoint directory needs config.json and weight files")
        files = [p / "config.json", *files]
        try:
            stamp = tuple((f.name, str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
        except OSError as e:
            raise UserError(f"{flag} {model}: cannot be read ({e.strerror or e})") from None
        return _dir_digest(stamp, flag)
    raise UserError(
        f"{flag} {model}: neither a shipped config ({', '.join(shipped_configs())}) nor a checkpoint "
        "directory or a .json config"
    )


@functools.lru_cache(maxsize=16)
def _dir_digest(stamp: tuple[tuple[str, str, int, int], ...], flag: str) -> str:
    """sha256 over (file name, file sha256) of a checkpoint's files; cached on their paths, sizes and mtimes."""
    h = hashlib.sha256()
    for name, path, _, _ in stamp:
        h.update(f"{name}\0{file_digest(path, flag)}\0".encode())
    return "dir:" + h.hexdigest()


def shipped_digest() -> str:
    """`model_digest` of the shipped trained model."""
    return model_digest("")


def model_tasks(digest: str) -> tuple[tuple[str, ...], str]:
    """(the tasks a model's runs accept, whose they are): the trained model's three for the shipped model (as
    `eval quality` accepts), the whole suite for another model."""
    from flashmemory.tasks.suite import TASKS

    if digest == shipped_digest():
        return TRAINED_TASKS, "the trained model's"
    return tuple(TASKS), "the suite's"


def harness_config(fc):
    """The harness settings every document of the run replays with (`eval.harness.HarnessConfig`)."""
    from flashmemory.eval.harness import HarnessConfig
    from flashmemory.eval.monitored import MonitorEvalConfig

    return HarnessConfig(
        tau=fc.tau,
        page_chunks=fc.page_chunks,
        tail_chunks=fc.tail_chunks,
        threshold=fc.threshold,
        seed=fc.seed,
        methods=fc.methods,
        monitor=MonitorEvalConfig(search_from_target=True),
    )


def settings(fc) -> dict:
    """Every setting a document's numbers depend on, JSON-ready (lists, not tuples); checks --tasks against the
    model's tasks (`model_tasks`). Reads the model's and the retriever's bytes."""
    from flashmemory.residency.policy import SelectionConfig

    digest = model_digest(fc.model)
    allowed, whose = model_tasks(digest)
    check_tasks(fc.tasks, allowed, whose)
    key = {k: v for k, v in asdict(fc).items() if k not in ("out_dir", "n_per_task", "retriever", "model")}
    key["model"] = digest
    key["retriever"] = "sha256:" + file_digest(fc.retriever, "--retriever")
    hc = asdict(harness_config(fc))
    key["harness"] = {"monitor": hc["monitor"]}
    sel = asdict(SelectionConfig())
    key["selection_defaults"] = {
        k: v for k, v in sel.items() if k not in ("threshold", "last_keep", "page_chunks", "kmax")
    }
    return json.loads(json.dumps(key, sort_keys=True, default=str))


def fingerprint_of(key: dict) -> str:
    """sha256 (16 hex) of a settings dict."""
    return _sha(json.dumps({"scheme": 2, **key}, sort_keys=True, default=str).encode())[:16]


def legacy_fingerprint(fc, model_name: str) -> str:
    """The fingerprint records carried before they stored their settings: the model by `model_name` ("shipped"
    for the default), the retriever by its bytes."""
    key = {k: getattr(fc, k) for k in LEGACY_FIELDS}
    key["model"] = model_name
    key["retriever"] = file_digest(fc.retriever, "--retriever")
    return _sha(json.dumps(key, sort_keys=True, default=str).encode())[:16]


def legacy_reader(fc):
    """`eval.records.read_record`'s legacy hook for a run of `fc`: accepts (and marks "legacy": True) a record
    without settings whose fingerprint is `fc`'s legacy one with the shipped model, when fc's model is the shipped
    one by content; refuses, naming the file, one whose legacy fingerprint named fc's --model by its directory
    name (another model of that name would have given it too)."""
    shipped = model_digest(fc.model) == shipped_digest()
    old_ok = legacy_fingerprint(fc, SHIPPED) if shipped else None
    old_named = legacy_fingerprint(fc, Path(fc.model).name) if fc.model else None

    def accept(path: Path, rec: dict) -> bool:
        if "settings" in rec:
            return False
        if old_named is not None and rec.get("fingerprint") == old_named:
            raise UserError(
                f"{path}: written before models were fingerprinted by content, naming --model "
                f"{Path(fc.model).name} by its directory name only (it cannot show which model it holds); "
                "use another --out"
            )
        if old_ok is not None and rec.get("fingerprint") == old_ok:
            rec["legacy"] = True
            return True
        return False

    return accept


def settings_diff(mine: dict, other: dict, skip: tuple[str, ...] = COMPARE_FREE) -> str | None:
    """The first setting (sorted by name) in which two settings dicts differ, outside `skip`, as "--flag a vs
    b" words; None when they agree."""
    for k in sorted(set(mine) | set(other)):
        if k in skip or mine.get(k) == other.get(k):
            continue
        a, b = mine.get(k), other.get(k)
        if k == "budgets":
            return f"budgets differ (--budgets {_list(b)} there, {_list(a)} here)"
        if k in ("model", "retriever"):
            return f"--{k} differs (another {k}: content {str(b)[:23]}.. there, {str(a)[:23]}.. here)"
        name = f"--{k.replace('_', '-')}" if k in FLAGS else f"setting {k}"
        return f"{name} differs ({_short(b)} there, {_short(a)} here)"
    return None


def _list(v) -> str:
    return ",".join(f"{x:g}" if isinstance(x, float) else str(x) for x in v) if isinstance(v, list) else str(v)


def _short(v) -> str:
    return _list(v) if isinstance(v, list) else json.dumps(v, sort_keys=True)[:120]
