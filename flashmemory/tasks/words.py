"""Aggregation tasks (RULER cwe / fwe), where top-k attention is known to struggle: the answer depends on the
whole context, not one needle. No needle, so depth is None.

- cwe: a numbered list where `count` common words appear `freq_cw` times each and the rest 3 times each
  (RULER), then more often as the length grows (the word pool is finite), always fewer than freq_cw times;
  answer the `count` most common words. freq_cw is 30 (RULER) at moderate lengths, at least 5, and
  grows at long lengths so the rare words can fill the list.
- fwe: a text of words drawn with Zipf(2) counts; answer the `count` most frequent words. Counts of the top
  count+1 ranks are forced strictly decreasing so the answer is unique.
"""

from __future__ import annotations

import math
import random

from flashmemory.tasks.haystack import NOUNS, Built

UCW_FREQ = 3


def common_words(seed: str, length: int, count: int):
    if count < 1:
        raise ValueError(f"cwe needs count >= 1 common words, got {count}")
    rng = random.Random(seed)
    words = rng.sample(NOUNS, len(NOUNS))
    common, rare = words[:count], words[count:]
    # ~4 tokens per list item ("12. apple" + newline): the common words take about half of a short list;
    # at long lengths each rare word must repeat ~items/len(rare) times, so the common ones repeat twice that.
    items = length // 4
    freq_cw = max(5, min(30, items // 2 // count), 2 * math.ceil(items / len(rare)) + 2)
    question = f"what are the {count} most common words in the list above? answer with the words only, one per line."
    intro = (
        "below is a numbered list of words. in these words, some appear more often than others. memorize the "
        "ones that appear most often."
    )

    def make(size: int) -> Built:
        counts = rare_counts(len(rare), size, freq_cw - 1)
        r = random.Random(f"{seed}:{size}")
        items = [w for w in common for _ in range(freq_cw)] + [w for w, c in zip(rare, counts) for _ in range(c)]
        r.shuffle(items)
        listing = "\n".join(f"{i + 1}. {w}" for i, w in enumerate(items))
        content = f"{intro}\n{listing}\n{question}"
        return Built(
            [{"role": "user", "content": content}],
            list(common),
            None,
            {"freq_cw": freq_cw, "n_rare": sum(c > 0 for c in counts), "n_items": len(items)},
        )

    return make


def rare_counts(n_rare: int, size: int, cap: int) -> list[int]:
    """Spread `size` occurrences over the rare words: UCW_FREQ each, word by word, then round robin, <= cap."""
    base = min(size, UCW_FREQ * n_rare)
    counts = [UCW_FREQ] * (base // UCW_FREQ) + [0] * (n_rare - base // UCW_FREQ)
    if base // UCW_FREQ < n_rare:
        counts[base // UCW_FREQ] += base % UCW_FREQ
    per, rem = divmod(size - base, n_rare)
    return [min(cap, c + per + (j < rem)) for j, c in enumerate(counts)]


def zipf_counts(n_words: int, total: int, top: int, alpha: float = 2.0) -> list[int]:
    """Counts per rank ~ total / r^alpha, >= 1, with the first top+1 ranks strictly decreasing."""
    h = sum(1 / r**alpha for r in range(1, n_words + 1))
    counts = [max(1, round(total / (r**alpha) / h)) for r in range(1, n_words + 1)]
    for i in range(min(top + 1, n_words) - 1, 0, -1):
        if counts[i - 1] <= counts[i]:
            counts[i - 1] = counts[i] + 1
    return counts


def frequent_words(seed: str, length: int, count: int):
    if count < 1:
        raise ValueError(f"fwe needs count >= 1, got {count}")
    n_words = max(4 * count, 30)
    if n_words > len(NOUNS):
        raise ValueError(f"fwe count={count} needs {n_words} distinct words, the pool has {len(NOUNS)}")
    rng = random.Random(seed)
    vocab = rng.sample(NOUNS, n_words)
    intro = "read the following text and find the most frequent words in it. memorize them."
    question = f"what are the {count} most frequent words in the text above? answer with the words only."

    def make(size: int) -> Built:
        counts = zipf_counts(n_words, size, count)
        seq = [w for w, c in zip(vocab, counts) for _ in range(c)]
        random.Random(f"{seed}:{size}").shuffle(seq)
        lines = "\n".join(" ".join(seq[i : i + 16]) + "." for i in range(0, len(seq), 16))
        content = f"{intro}\n{lines}\n{question}"
        return Built(
            [{"role": "user", "content": content}],
            vocab[:count],
            None,
            {"n_words": len(seq), "top_counts": counts[: count + 1]},
        )

    return make
