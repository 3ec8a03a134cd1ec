"""Raw categorical keys -> table ids: modulo the table size, or a counted vocabulary.

Raw keys are non-negative int64 (a Criteo hex hash, a hashed string, a Parquet
integer); :data:`~hybridrec.data.chunk.MISSING` (-1) marks an empty one-hot value.
Both encodings send a missing value to id 0.

- modulo: ``id = key % table_size`` (collisions are accepted, as in the DLRM
  reference preprocessing).
- vocabulary: keys seen at least ``min_count`` times in the training parts get
  ids ``1..V`` in increasing key order; id 0 is "missing or rare". With a table
  size as well, keys are reduced modulo the table size before counting.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from hybridrec.errors import ConfigError


class ModuloEncoder:
    """``id = key % table_size``; missing -> 0."""

    def __init__(self, table_size: int) -> None:
        self.table_size = int(table_size)

    @property
    def num_embeddings(self) -> int:
        return self.table_size

    def __call__(self, keys: np.ndarray) -> np.ndarray:
        ids = np.remainder(keys, self.table_size)
        ids[keys < 0] = 0
        return ids.astype(np.int32)


class VocabEncoder:
    """Keys in ``vocab`` -> ``1 + position``; anything else -> 0.

    ``vocab`` is sorted as counting makes it; a vocabulary grown by ``preprocess --like
    --grow`` has its new keys appended after the sorted ones (their rows come last), so
    an unsorted one is looked up through its sorting permutation."""

    def __init__(self, vocab: np.ndarray, modulo: int | None = None) -> None:
        self.vocab = np.asarray(vocab, dtype=np.int64)
        self.modulo = modulo
        ordered = bool(np.all(self.vocab[1:] > self.vocab[:-1]))
        self._order = None if ordered else np.argsort(self.vocab, kind="stable")
        self._sorted = self.vocab if ordered else self.vocab[self._order]

    @property
    def num_embeddings(self) -> int:
        return len(self.vocab) + 1

    def reduce(self, keys: np.ndarray) -> np.ndarray:
        """The keys the vocabulary is counted on (modulo first, when a table size is set)."""
        if self.modulo is None:
            return keys
        return np.where(keys < 0, keys, np.remainder(keys, self.modulo))

    def __call__(self, keys: np.ndarray) -> np.ndarray:
        k = self.reduce(keys)
        if len(self.vocab) == 0:
            return np.zeros(k.shape, dtype=np.int32)
        pos = np.minimum(np.searchsorted(self._sorted, k), len(self.vocab) - 1)
        hit = self._sorted[pos] == k
        if self._order is not None:
            pos = self._order[pos]
        return np.where(hit & (k >= 0), pos + 1, 0).astype(np.int32)

    @staticmethod
    def from_counts(
        keys: np.ndarray, counts: np.ndarray, min_count: int, modulo: int | None = None
    ) -> VocabEncoder:
        """``keys`` sorted unique (as :meth:`KeyCounter.result` returns them)."""
        keep = (counts >= min_count) & (keys >= 0)
        return VocabEncoder(keys[keep], modulo)


class KeyCounter:
    """Exact counts of arbitrary int64 keys, merged with ``np.unique`` (memory ~ distinct keys)."""

    def __init__(self) -> None:
        self._keys: list[np.ndarray] = []
        self._counts: list[np.ndarray] = []
        self._pending = 0
        self._merged = 0

    def add(self, keys: np.ndarray) -> None:
        if keys.size == 0:
            return
        u, c = np.unique(keys, return_counts=True)
        self._keys.append(u)
        self._counts.append(c.astype(np.int64))
        self._pending += u.size
        if self._pending > max(1 << 22, 2 * self._merged):  # amortized: merge when doubled
            self._merge()

    def _merge(self) -> None:
        if len(self._keys) > 1:
            k = np.concatenate(self._keys)
            u, inv = np.unique(k, return_inverse=True)
            c = np.bincount(inv, weights=np.concatenate(self._counts), minlength=u.size)
            self._keys, self._counts = [u], [c.astype(np.int64)]  # float64 exact below 2**53
        self._merged = self._keys[0].size if self._keys else 0
        self._pending = self._merged

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """``(sorted unique keys, counts)``."""
        self._merge()
        if not self._keys:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return self._keys[0], self._counts[0]


def resolve_table_sizes(
    table_size: int | str | Mapping[str, int] | Sequence[int] | None, names: Sequence[str]
) -> dict[str, int] | None:
    """Per-feature table sizes from the forms the API and CLI accept.

    - ``None``: no modulo.
    - ``int``: the same size for every feature.
    - ``{name: size}``; the key ``"*"`` gives a default for unlisted features.
    - ``[size, ...]``: one per feature, in order.
    - a string: ``"N"``, ``"N1,N2,..."`` (one per feature), or ``"N,C3=M,C7=K"``
      (default N with overrides).
    """
    if table_size is None:
        return None
    if isinstance(table_size, str):
        table_size = _parse_table_size(table_size, len(names))
    if isinstance(table_size, (int, np.integer)):
        sizes = {n: int(table_size) for n in names}
    elif isinstance(table_size, Mapping):
        unknown = sorted(set(table_size) - set(names) - {"*"})
        if unknown:
            raise ConfigError(f"table_size: unknown features {unknown} (have {list(names)})")
        missing = [n for n in names if n not in table_size and "*" not in table_size]
        if missing:
            raise ConfigError(f"table_size: no size for features {missing} (add '*' for a default)")
        sizes = {n: int(table_size.get(n, table_size.get("*", 0))) for n in names}
    else:
        if len(table_size) != len(names):
            raise ConfigError(
                f"table_size: {len(table_size)} sizes given for {len(names)} features"
            )
        sizes = {n: int(s) for n, s in zip(names, table_size)}
    bad = {n: s for n, s in sizes.items() if not 1 <= s < 2**31}
    if bad:
        raise ConfigError(f"table_size: sizes must be in [1, 2**31): {bad}")
    return sizes


def _parse_table_size(text: str, n_features: int) -> int | dict[str, int] | list[int]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    try:
        if all("=" not in t for t in items):
            sizes = [int(t) for t in items]
            if len(sizes) == 1:
                return sizes[0]
            if len(sizes) == n_features:
                return sizes
            raise ConfigError(
                f"table size {text!r}: give one size, one per feature ({n_features}), "
                "or NAME=SIZE overrides"
            )
        out: dict[str, int] = {}
        for t in items:
            name, _, size = t.rpartition("=")
            out[name.strip() or "*"] = int(size)
        return out
    except ValueError:
        raise ConfigError(f"table size {text!r}: not an integer") from None
