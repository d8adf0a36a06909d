"""Per-request dump control between `flashmemory dump --backend sglang` and a dump-mode sglang server.

The client sends OpenAI chat completions whose JSON body carries (what the openai client sends for
`extra_body={"custom_params": {"flashmemory_dump": {...}}}`):

    "custom_params": {"flashmemory_dump": {"version": 2, "pass": 1 | 2, "doc_index": int,
        "output_dir": "/abs/staging", "topp": float, "min_layers": int,
        "target_csa_layers": [c4 ids], "n_logit_tokens": 3,
        "store_topk": "none" | "cycle" | "all", "topk_interval": int}}

Version 2 added store_topk / topk_interval (which decode steps of a pass-1 document keep the native
top-k of every c4 layer, as `format.topk_store_steps` picks them; pass 2 stores none). A version-1
block (or any block without those fields) still parses, with the defaults; a version-1 server refuses
a version-2 block ("this side speaks version 1") rather than silently dropping the top-k.

Field rules (a breach is a DumpProtocolError naming the field): integers are JSON integers (no strings, no
bools); target_csa_layers is a JSON list of distinct ids (a string such as "10" is refused, never read as
layers 1 and 0); n_logit_tokens in [0, MAX_LOGIT_TOKENS]; output_dir absolute without '..'. custom_params
itself must be an object. The server adds what only it knows (`flashmemory.sglang.dump.mode.parse_request`):
output_dir must lie under the operator's SGLANG_FLASHMEMORY_DUMP_ROOT (`under_root`), the layer ids and
min_layers must fit the served model's c4 layers, and the document must be writable there without following
a symlink (`flashmemory.dump.confine.DocTargets`: checked at admission, and again at the write).

No shared /tmp command file: each request says what to record. The server (dump mode,
SGLANG_FLASHMEMORY_DUMP=1) records that request only and, when it finishes, writes with
`flashmemory.dump.writer.save_doc_file` (atomic, relative to a directory descriptor walked from the root):
  pass 1: `{output_dir}/pass1/doc_{doc_index:05d}.safetensors`, a full document (hidden, positions,
          labels over all c4 layers, first-token logits, compk of what it has, the stored native top-k);
  pass 2: `{output_dir}/pass2/doc_{doc_index:05d}.safetensors`, whose `compk_layer_{L}` cover
          prompt + response (the client only reads those keys).
The client polls for the file, merges pass-2 keys into pass 1 and commits the document itself.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from flashmemory.dump.format import STORE_TOPK_MODES

PARAM_KEY = "flashmemory_dump"
VERSION = 2
SUPPORTED_VERSIONS = (1, 2)  # 1: no store_topk / topk_interval fields (they take their defaults)
MAX_LOGIT_TOKENS = 64  # first decode steps whose full native logits a document keeps (upstream: 3)


def one_line(text: str) -> str:
    """`text` with every control character escaped (a newline as `\\n`, others as `\\xNN`): a refusal quotes the
    client's output_dir, and a path may hold any byte but `/` and NUL, so a raw one could split the server's log line
    and the client's error in two."""
    return "".join(
        c if c.isprintable() or c == " " else {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(c, f"\\x{ord(c):02x}")
        for c in text
    )


class DumpProtocolError(ValueError):
    """A `flashmemory_dump` request field is missing or invalid. The message is always one line (`one_line`): the
    server logs it and hands it to the client as the request's HTTP 400 reason."""

    def __init__(self, message: str = "") -> None:
        super().__init__(one_line(str(message)))


@dataclass(frozen=True)
class DumpRequest:
    pass_: int
    doc_index: int
    output_dir: str
    topp: float = 0.6
    min_layers: int = 3
    target_csa_layers: tuple[int, ...] = (10, 12, 20)
    n_logit_tokens: int = 3
    store_topk: str = "cycle"
    topk_interval: int = 64
    version: int = VERSION

    def __post_init__(self) -> None:
        if self.version not in SUPPORTED_VERSIONS:
            raise DumpProtocolError(
                f"{PARAM_KEY}.version={self.version}: this side speaks version(s) "
                f"{', '.join(map(str, SUPPORTED_VERSIONS))}"
            )
        if self.pass_ not in (1, 2):
            raise DumpProtocolError(f"{PARAM_KEY}.pass={self.pass_}: expected 1 or 2")
        if self.doc_index < 0:
            raise DumpProtocolError(f"{PARAM_KEY}.doc_index={self.doc_index}: must be >= 0")
        od = self.output_dir
        if not isinstance(od, str) or not Path(od).is_absolute() or "\0" in od:
            raise DumpProtocolError(f"{PARAM_KEY}.output_dir={od!r}: must be absolute (the server writes it)")
        if ".." in Path(od).parts:
            raise DumpProtocolError(f"{PARAM_KEY}.output_dir={od!r}: must not contain '..'")
        if not (isinstance(self.topp, (int, float)) and math.isfinite(self.topp) and 0.0 <= self.topp <= 1.0):
            raise DumpProtocolError(f"{PARAM_KEY}.topp={self.topp}: must lie in [0, 1]")
        if self.min_layers < 1:
            raise DumpProtocolError(f"{PARAM_KEY}.min_layers={self.min_layers}: must be >= 1")
        layers = self.target_csa_layers
        if (
            not isinstance(layers, tuple)
            or not layers
            or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in layers)
            or len(set(layers)) != len(layers)
        ):
            raise DumpProtocolError(
                f"{PARAM_KEY}.target_csa_layers={layers!r}: must be a non-empty list of distinct "
                "c4-layer ids (integers >= 0)"
            )
        if not 0 <= self.n_logit_tokens <= MAX_LOGIT_TOKENS:
            raise DumpProtocolError(
                f"{PARAM_KEY}.n_logit_tokens={self.n_logit_tokens}: must lie in [0, {MAX_LOGIT_TOKENS}]"
            )
        if not isinstance(self.store_topk, str) or self.store_topk not in STORE_TOPK_MODES:
            raise DumpProtocolError(
                f"{PARAM_KEY}.store_topk={self.store_topk!r}: expected one of {', '.join(STORE_TOPK_MODES)}"
            )
        ti = self.topk_interval
        if isinstance(ti, bool) or not isinstance(ti, int) or ti < 1:
            raise DumpProtocolError(f"{PARAM_KEY}.topk_interval={self.topk_interval!r}: must be an integer >= 1")

    def to_custom_params(self) -> dict:
        d = asdict(self)
        d["pass"] = d.pop("pass_")
        d["target_csa_layers"] = list(self.target_csa_layers)
        return {PARAM_KEY: d}

    @classmethod
    def from_custom_params(cls, custom_params: dict | None) -> "DumpRequest | None":
        """Parse a request's custom_params; None when it carries no dump block (a normal request)."""
        if custom_params is None:
            return None
        if not isinstance(custom_params, dict):
            raise DumpProtocolError(
                f"custom_params: expected an object (with a {PARAM_KEY} block), got {type(custom_params).__name__}"
            )
        if PARAM_KEY not in custom_params:
            return None
        d = custom_params[PARAM_KEY]
        if not isinstance(d, dict):
            raise DumpProtocolError(f"{PARAM_KEY}: expected an object, got {type(d).__name__}")
        missing = [k for k in ("pass", "doc_index", "output_dir") if k not in d]
        if missing:
            raise DumpProtocolError(f"{PARAM_KEY}: missing field(s) {missing}")
        version = _field(d, "version", int, VERSION)
        if version not in SUPPORTED_VERSIONS:  # before the other fields: a newer block may mean them differently
            raise DumpProtocolError(
                f"{PARAM_KEY}.version={version}: this side speaks version(s) "
                f"{', '.join(map(str, SUPPORTED_VERSIONS))}; update flashmemory on both sides"
            )
        return cls(
            pass_=_field(d, "pass", int),
            doc_index=_field(d, "doc_index", int),
            output_dir=_field(d, "output_dir", str),
            topp=_field(d, "topp", float, 0.6),
            min_layers=_field(d, "min_layers", int, 3),
            target_csa_layers=_field(d, "target_csa_layers", _int_list, (10, 12, 20)),
            n_logit_tokens=_field(d, "n_logit_tokens", int, 3),
            store_topk=_field(d, "store_topk", str, "cycle"),
            topk_interval=_field(d, "topk_interval", int, 64),
            version=version,
        )

    def doc_path(self) -> Path:
        """Where the server writes this request's file."""
        return Path(self.output_dir) / f"pass{self.pass_}" / f"doc_{self.doc_index:05d}.safetensors"


def under_root(output_dir: str, root: str | os.PathLike | None) -> Path:
    """The real path of `output_dir` if it lies inside `root` (symlinks resolved on both), else
    DumpProtocolError. root None: the server has no dump root, so nothing may be written."""
    if root is None or str(root) == "":
        raise DumpProtocolError(
            f"{PARAM_KEY}.output_dir={output_dir!r}: this server has no dump root "
            "(SGLANG_FLASHMEMORY_DUMP_ROOT), so it writes no dump"
        )
    real, base = Path(os.path.realpath(output_dir)), Path(os.path.realpath(root))
    if real != base and base not in real.parents:
        raise DumpProtocolError(
            f"{PARAM_KEY}.output_dir={output_dir!r}: outside the server's dump root {base} "
            "(SGLANG_FLASHMEMORY_DUMP_ROOT)"
        )
    return real


def _to_int(v: object) -> int:
    """v as an int: a JSON integer, or an integral float (2.0 is 2). No bool, no string, no fraction."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise ValueError(f"{v!r} is not an integer")
    return int(v)


def _to_float(v: object) -> float:
    """v as a float: a JSON number (no bool, no string)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{v!r} is not a number")
    return float(v)


def _int_list(v: object) -> tuple[int, ...]:
    """A JSON list of integers. A string is refused (\"10\" must not read as layers 1 and 0)."""
    if not isinstance(v, (list, tuple)):
        raise ValueError(f"expected a list of integers, got {type(v).__name__}")
    return tuple(_to_int(x) for x in v)


def _field(d: dict, name: str, conv, default: object = None) -> object:
    """d[name] (or the default when absent) converted; a bad value is a DumpProtocolError naming the field."""
    if name not in d:
        return default
    v = d[name]
    if conv is str and not isinstance(v, str):
        raise DumpProtocolError(f"{PARAM_KEY}.{name}={v!r}: bad field value (expected a string)")
    try:
        return _to_int(v) if conv is int else _to_float(v) if conv is float else conv(v)
    except (TypeError, ValueError, OverflowError) as e:
        raise DumpProtocolError(f"{PARAM_KEY}.{name}={v!r}: bad field value ({e})") from None
