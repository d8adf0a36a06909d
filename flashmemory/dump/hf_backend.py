"""The in-process CPU dump backend on `flashmemory.hf`.

Pass 1 is a greedy `generate`; pass 2 is one teacher-forced forward over prompt + response, from
which everything is taken (so the keys cover the response, as upstream's max_tokens=1 pass 2 does).
Decode step t is the query at position P+t (input = response token t); its labels come from the
native indexer logits of every c4 layer at that row. The same rows give the stored native top-k
(`cfg.store_topk`) of every c4 layer.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from flashmemory.dump.backend import DumpConfig, DumpItemError
from flashmemory.dump.format import DumpDoc, native_topk_rows, topk_store_steps
from flashmemory.dump.inputs import ByteChatTokenizer, InputItem, Tokenize
from flashmemory.labels.golden import golden_labels

DEFAULT_TOKEN_LIMIT = 8192  # prompt + response tokens per item on the CPU engine unless --max-prompt-tokens says


def doc_from_capture(
    cap,
    prompt_ids: list[int],
    response_ids: list[int],
    cfg: DumpConfig,
    *,
    doc_index: int,
    rid: str,
    index_topk: int,
    n_c4_layers: int,
    ratio: int = 4,
) -> DumpDoc:
    """Build a DumpDoc from a `ForwardCapture` of one forward over prompt + response (S = P + T rows)."""
    from flashmemory.hf import stored_index_keys

    P, T = len(prompt_ids), len(response_ids)
    rows = slice(P, P + T)
    labels = golden_labels(
        [cap.index_logits[c][rows] for c in range(n_c4_layers)],
        topk=index_topk,
        topp=cfg.topp,
        min_layers=cfg.min_layers,
    )
    positions = torch.arange(P, P + T, dtype=torch.int64)
    logits = {}
    for c in cfg.target_layers:
        for t in range(min(cfg.n_logit_tokens, T)):
            logits[(c, t)] = cap.index_logits[c][P + t, : (P + t + 1) // ratio].float().clone()
    steps = topk_store_steps(T, cfg.store_topk, cfg.topk_interval)
    n_vis = torch.div(P + steps.long() + 1, ratio, rounding_mode="floor")
    topk = (
        {c: native_topk_rows(cap.index_logits[c][P + steps.long()], n_vis, index_topk) for c in range(n_c4_layers)}
        if steps.numel()
        else {}
    )
    if not topk:
        steps = steps[:0]
    return DumpDoc(
        doc_index=doc_index,
        rid=rid,
        hidden={c: cap.hidden[c][rows].float().clone() for c in cfg.target_layers},
        positions={c: positions.clone() for c in cfg.target_layers},
        compk={c: stored_index_keys(cap.index_keys[c]) for c in cfg.target_layers},
        label_indices=labels.indices,
        label_scores=labels.scores,
        label_pointers=labels.pointers,
        n_prompt_blocks=P // ratio,
        ratio=ratio,
        native_logits=logits,
        topp=cfg.topp,
        min_layers=cfg.min_layers,
        input_ids=torch.tensor(list(prompt_ids) + list(response_ids), dtype=torch.int64),
        native_topk=topk,
        native_topk_steps=steps,
    )


class HFBackend:
    """Dumps with a seeded tiny model (`micro`, `tiny-flash`) or a config/checkpoint directory."""

    name = "hf"

    def __init__(self, model: str = "micro", seed: int = 0, thinking: bool = False, tokenize: Tokenize | None = None):
        from flashmemory.hf import HFEngine, load_model

        self.engine = HFEngine(*load_model(model, seed=seed))
        self.model_name = model
        self.provenance = {"model": model, "seed": int(seed)}  # in every metadata line: `verify` checks the seed
        self.tokenize: Tokenize = tokenize or ByteChatTokenizer(self.engine.vocab_size, thinking=thinking)
        self.eos = getattr(self.engine.config, "eos_token_id", None)

    @property
    def n_c4_layers(self) -> int:
        return self.engine.n_c4_layers

    def token_limit(self, cfg: DumpConfig) -> int:
        """Most prompt + response tokens one item may have: `cfg.max_prompt_tokens`, else DEFAULT_TOKEN_LIMIT
        (eager CPU attention allocates O(S^2) per layer), never past the model's max_position_embeddings."""
        limit = cfg.max_prompt_tokens or DEFAULT_TOKEN_LIMIT
        return min(limit, int(getattr(self.engine.config, "max_position_embeddings", limit) or limit))

    def dump_one(self, item: InputItem, doc_index: int, rid: str, cfg: DumpConfig) -> DumpDoc:
        eng = self.engine
        limit = self.token_limit(cfg)
        n_chars = sum(len(m["content"]) for m in item.messages)
        if n_chars > 4 * limit:  # cheap bound first: the byte tokenizer makes >= 1 token per 4 UTF-8 bytes
            raise DumpItemError(
                f"{item.where}: prompt of {n_chars} characters is far over the {limit}-token limit "
                "(--max-prompt-tokens); item skipped"
            )
        prompt = list(self.tokenize(item.messages))
        if len(prompt) + cfg.max_tokens > limit:
            raise DumpItemError(
                f"{item.where}: prompt of {len(prompt)} tokens + --max-tokens {cfg.max_tokens} exceeds "
                f"the {limit}-token limit (--max-prompt-tokens); item skipped"
            )
        if len(prompt) < eng.ratio:
            raise DumpItemError(f"{item.where}: prompt has {len(prompt)} tokens, fewer than one chunk ({eng.ratio})")
        bad = [i for i in prompt if not 0 <= i < eng.vocab_size]
        if bad:
            raise DumpItemError(f"{item.where}: tokenizer produced ids outside [0, {eng.vocab_size}): {bad[:5]}")
        response = eng.generate(prompt, cfg.max_tokens, eos_token_id=self.eos)
        if not response:
            raise DumpItemError(f"{item.where}: empty response (max_tokens={cfg.max_tokens})")
        cap = eng.forward(prompt + response, capture_layers=list(cfg.target_layers))
        return doc_from_capture(
            cap,
            prompt,
            response,
            cfg,
            doc_index=doc_index,
            rid=rid,
            index_topk=eng.index_topk,
            n_c4_layers=eng.n_c4_layers,
            ratio=eng.ratio,
        )

    def dump_batch(
        self, jobs: list[tuple[InputItem, int, str]], cfg: DumpConfig
    ) -> Iterator[tuple[InputItem, DumpDoc | DumpItemError]]:
        """jobs: (item, doc_index, rid). Yields (item, doc or the item's DumpItemError) in order."""
        for item, doc_index, rid in jobs:
            try:
                yield item, self.dump_one(item, doc_index, rid, cfg)
            except DumpItemError as e:
                yield item, e
