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

No shared /tmp command file: each request says what to record. The server (dump mode,
SGLANG_FLASHMEMORY_DUMP=1) records that request only and, when it finishes, writes with
`flashmemory.dump.writer.save_doc_file` (atomic):
  pass 1: `{output_dir}/pass1/doc_{doc_index:05d}.safetensors`, a full document (hidden, positions,
          labels over all c4 layers, first-token logits, compk of what it has, the stored native top-k);
  pass 2: `{output_dir}/pass2/doc_{doc_index:05d}.safetensors`, whose `compk_layer_{L}` cover
          prompt + response (the client only reads those keys).
The client polls for the file, merges pass-2 keys into pass 1 and commits the document itself.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from flashmemory.dump.format import STORE_TOPK_MODES

PARAM_KEY = "flashmemory_dump"
VERSION = 2
SUPPORTED_VERSIONS = (1, 2)   # 1: no store_topk / topk_interval fields (they take their defaults)


class DumpProtocolError(ValueError):
    """A `flashmemory_dump` request field is missing or invalid."""


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
            raise DumpProtocolError(f"{PARAM_KEY}.version={self.version}: this side speaks version(s) "
                                    f"{', '.join(map(str, SUPPORTED_VERSIONS))}")
        if self.pass_ not in (1, 2):
            raise DumpProtocolError(f"{PARAM_KEY}.pass={self.pass_}: expected 1 or 2")
        if self.doc_index < 0:
            raise DumpProtocolError(f"{PARAM_KEY}.doc_index={self.doc_index}: must be >= 0")
        if not Path(self.output_dir).is_absolute():
            raise DumpProtocolError(f"{PARAM_KEY}.output_dir={self.output_dir!r}: must be absolute (the server writes it)")
        if not 0.0 <= self.topp <= 1.0:
            raise DumpProtocolError(f"{PARAM_KEY}.topp={self.topp}: must lie in [0, 1]")
        if self.min_layers < 1 or not self.target_csa_layers:
            raise DumpProtocolError(f"{PARAM_KEY}: min_layers >= 1 and a non-empty target_csa_layers are required")
        if not isinstance(self.store_topk, str) or self.store_topk not in STORE_TOPK_MODES:
            raise DumpProtocolError(f"{PARAM_KEY}.store_topk={self.store_topk!r}: expected one of "
                                    f"{', '.join(STORE_TOPK_MODES)}")
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
        if not custom_params or PARAM_KEY not in custom_params:
            return None
        d = custom_params[PARAM_KEY]
        if not isinstance(d, dict):
            raise DumpProtocolError(f"{PARAM_KEY}: expected an object, got {type(d).__name__}")
        missing = [k for k in ("pass", "doc_index", "output_dir") if k not in d]
        if missing:
            raise DumpProtocolError(f"{PARAM_KEY}: missing field(s) {missing}")
        version = _field(d, "version", int, VERSION)
        if version not in SUPPORTED_VERSIONS:  # before the other fields: a newer block may mean them differently
            raise DumpProtocolError(f"{PARAM_KEY}.version={version}: this side speaks version(s) "
                                    f"{', '.join(map(str, SUPPORTED_VERSIONS))}; update flashmemory on both sides")
        return cls(pass_=_field(d, "pass", int), doc_index=_field(d, "doc_index", int),
                   output_dir=_field(d, "output_dir", str), topp=_field(d, "topp", float, 0.6),
                   min_layers=_field(d, "min_layers", int, 3),
                   target_csa_layers=_field(d, "target_csa_layers", lambda v: tuple(map(_to_int, v)), (10, 12, 20)),
                   n_logit_tokens=_field(d, "n_logit_tokens", int, 3),
                   store_topk=_field(d, "store_topk", str, "cycle"), topk_interval=_field(d, "topk_interval", int, 64),
                   version=version)

    def doc_path(self) -> Path:
        """Where the server writes this request's file."""
        return Path(self.output_dir) / f"pass{self.pass_}" / f"doc_{self.doc_index:05d}.safetensors"


def _to_int(v: object) -> int:
    """int(v), but no bool and no silently truncated fraction (1.5 is an error, 2.0 is 2)."""
    if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
        raise ValueError(f"{v!r} is not an integer")
    return int(v)  # type: ignore[arg-type]


def _field(d: dict, name: str, conv, default: object = None) -> object:
    """d[name] (or the default when absent) converted; a bad value is a DumpProtocolError naming the field."""
    if name not in d:
        return default
    v = d[name]
    if conv is str and not isinstance(v, str):
        raise DumpProtocolError(f"{PARAM_KEY}.{name}={v!r}: bad field value (expected a string)")
    try:
        return _to_int(v) if conv is int else conv(v)
    except (TypeError, ValueError) as e:
        raise DumpProtocolError(f"{PARAM_KEY}.{name}={v!r}: bad field value ({e})") from None
