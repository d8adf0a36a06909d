"""What every dump backend shares: the run config, the per-item error, the backend protocol, layer choice."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from flashmemory.dump.format import N_LOGIT_TOKENS, STORE_TOPK_MODES, DumpDoc
from flashmemory.dump.inputs import InputItem

DEFAULT_TARGET_LAYERS = (10, 12, 20)


class DumpItemError(ValueError):
    """One input item cannot be dumped (too short, too long, empty response); the run reports it and goes on.

    permanent: the same input would fail again (it is recorded, and a rerun skips it); False for what may
    pass on a retry (a server error or timeout).
    """

    def __init__(self, message: str, permanent: bool = True):
        super().__init__(message)
        self.permanent = permanent


class DumpBackendError(RuntimeError):
    """The backend cannot run at all (server unreachable, model lacks the layers); the run stops."""


@dataclass(frozen=True)
class DumpConfig:
    """One dump run's settings. store_topk / topk_interval: which decode steps keep the native top-k of
    every c4 layer ("none", "cycle" = t % topk_interval == 0, "all"); both backends store it."""

    topp: float = 0.6
    min_layers: int = 3
    target_layers: tuple[int, ...] = DEFAULT_TARGET_LAYERS
    max_tokens: int = 2048
    thinking: bool = False
    n_logit_tokens: int = N_LOGIT_TOKENS
    store_topk: str = "cycle"
    topk_interval: int = 64
    max_prompt_tokens: int | None = None  # prompt + max_tokens above this fails that item (None: the backend's limit)

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r}: must be an integer >= 1")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens={self.max_prompt_tokens}: must be >= 1")
        if self.n_logit_tokens < 0:
            raise ValueError(f"n_logit_tokens={self.n_logit_tokens}: must be >= 0")
        if self.store_topk not in STORE_TOPK_MODES:
            raise ValueError(f"store_topk={self.store_topk!r}: expected one of {', '.join(STORE_TOPK_MODES)}")
        if self.topk_interval < 1:
            raise ValueError(f"topk_interval={self.topk_interval}: must be >= 1")


class DumpBackend(Protocol):
    """A dump engine. It may also have `provenance`: a dict of JSON values the run adds to every metadata
    line, so a dump says how to reproduce it (the hf backend: its `model` and `seed`, which `verify` checks)."""

    name: str

    @property
    def n_c4_layers(self) -> int | None: ...  # None when the backend cannot tell (a remote server)

    def dump_batch(
        self, jobs: list[tuple[InputItem, int, str]], cfg: DumpConfig
    ) -> Iterator[tuple[InputItem, DumpDoc | DumpItemError]]: ...


def resolve_target_layers(requested: list[int] | None, n_c4_layers: int | None) -> tuple[tuple[int, ...], str]:
    """Pick the target CSA layers. Returns (layers, note for the user or "").

    Explicit layers must exist (c4-layer ids in [0, n_c4_layers)); otherwise an error names them.
    With none requested the upstream default 10 12 20 is used, or, on a model with too few c4 layers,
    the last min(3, n) c4 layers, and the note says so.
    """
    if requested:
        layers = tuple(sorted(set(int(x) for x in requested)))
        if n_c4_layers is not None:
            bad = [x for x in layers if not 0 <= x < n_c4_layers]
            if bad:
                raise DumpBackendError(
                    f"--target-csa-layers {' '.join(map(str, layers))}: the model has "
                    f"{n_c4_layers} c4 layers (ids 0..{n_c4_layers - 1}); {bad} do not exist"
                )
        return layers, ""
    if n_c4_layers is None or all(x < n_c4_layers for x in DEFAULT_TARGET_LAYERS):
        return DEFAULT_TARGET_LAYERS, ""
    layers = tuple(range(max(0, n_c4_layers - 3), n_c4_layers))
    return layers, (
        f"note: the model has {n_c4_layers} c4 layers, so the default target layers "
        f"{' '.join(map(str, DEFAULT_TARGET_LAYERS))} do not exist; using the last ones: "
        f"{' '.join(map(str, layers))} (pass --target-csa-layers to choose)"
    )
