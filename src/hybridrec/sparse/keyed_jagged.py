"""Jagged sparse inputs keyed by feature, and the training Batch.

A :class:`KeyedJagged` holds, for every feature (key), a variable number of ids
per sample, laid out key-major (all samples of key 0, then all of key 1, ...).
This is the layout the sharded embedding collection splits by key (table-wise)
or by value (row-wise) without any reshuffling.

Worked example, keys ``["f0", "f1"]`` and a batch of 3 samples::

    sample:     0        1       2
    f0:      [a, b]     []      [c]
    f1:       [d]      [e]     [f, g]

    keys    = ["f0", "f1"]
    values  = [a, b, c, d, e, f, g]          # int64, shape [nnz]
    lengths = [2, 0, 1, 1, 1, 2]             # int32, shape [num_keys * B]
    offsets = [0, 2, 2, 3, 4, 5, 7]          # int64, shape [num_keys * B + 1]

The bag of key ``k`` and sample ``s`` is ``values[offsets[k*B+s]:offsets[k*B+s+1]]``.
An empty bag pools to a zero vector.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class KeyedJagged:
    """Jagged ids for several features, key-major.

    Args:
        keys: feature names, one per key.
        values: int64 ids, shape ``[nnz]``.
        lengths: int32 bag sizes, shape ``[len(keys) * batch_size]``.
        length_per_key, one_id_per_bag: what :meth:`length_per_key` and
            :meth:`one_id_per_bag` return, when the maker knows it (not checked).
    """

    __slots__ = ("_length_per_key", "_offsets", "_one_id", "keys", "lengths", "values")

    def __init__(self, keys: list[str], values: torch.Tensor, lengths: torch.Tensor, *,
                 length_per_key: list[int] | None = None, one_id_per_bag: bool | None = None) -> None:
        if lengths.dim() != 1 or values.dim() != 1:
            raise ValueError("KeyedJagged: values and lengths must be 1-D")
        if len(keys) == 0:
            if lengths.numel() != 0:
                raise ValueError("KeyedJagged: lengths given for zero keys")
        elif lengths.numel() % len(keys) != 0:
            raise ValueError(
                f"KeyedJagged: {lengths.numel()} lengths do not split into {len(keys)} keys"
            )
        self.keys = list(keys)
        self.values = values
        self.lengths = lengths
        self._offsets: torch.Tensor | None = None
        # Facts its maker may know already (the loader does), else worked out when asked.
        self._length_per_key: list[int] | None = length_per_key
        self._one_id: bool | None = one_id_per_bag

    @staticmethod
    def from_dense(keys: list[str], ids: torch.Tensor) -> KeyedJagged:
        """One id per sample and key: ``ids`` is ``[B, len(keys)]``."""
        b, f = ids.shape
        if f != len(keys):
            raise ValueError(f"from_dense: ids has {f} columns for {len(keys)} keys")
        values = ids.t().reshape(-1).to(torch.int64)
        out = KeyedJagged(keys, values, torch.ones(b * f, dtype=torch.int32))
        out._one_id = True  # (known here: the training step does not look at the lengths)
        return out

    @staticmethod
    def from_lengths_per_key(
        keys: list[str], values_per_key: list[torch.Tensor], lengths_per_key: list[torch.Tensor]
    ) -> KeyedJagged:
        """Concatenate per-key ``(values, lengths)`` pairs."""
        values = torch.cat([v.to(torch.int64) for v in values_per_key]) if keys else torch.empty(0, dtype=torch.int64)
        lengths = torch.cat([l.to(torch.int32) for l in lengths_per_key]) if keys else torch.empty(0, dtype=torch.int32)
        return KeyedJagged(keys, values, lengths)

    @property
    def batch_size(self) -> int:
        return self.lengths.numel() // len(self.keys) if self.keys else 0

    def offsets(self) -> torch.Tensor:
        """Bag boundaries, int64 ``[len(keys) * B + 1]`` (cached)."""
        if self._offsets is None:
            off = torch.zeros(self.lengths.numel() + 1, dtype=torch.int64, device=self.lengths.device)
            torch.cumsum(self.lengths, 0, out=off[1:])
            self._offsets = off
        return self._offsets

    def length_per_key(self) -> list[int]:
        """Number of ids of each key in this batch (one host sync, cached)."""
        if self._length_per_key is None:
            b = self.batch_size
            # .tolist() syncs with the host: callers need Python ints to split values.
            self._length_per_key = (
                self.lengths.view(len(self.keys), b).sum(1).tolist() if b else [0] * len(self.keys)
            )
        return self._length_per_key

    def one_id_per_bag(self) -> bool:
        """Whether every bag holds exactly one id (one-hot features; one host sync, cached)."""
        if self._one_id is None:
            self._one_id = self.values.numel() == self.lengths.numel() and bool((self.lengths == 1).all())
        return self._one_id

    def _with_facts(self, other: KeyedJagged) -> KeyedJagged:
        """``other`` (this batch elsewhere) with this one's host-side facts, worked out here
        first when this batch is on the CPU: a batch copied to a GPU then never waits for
        the GPU to learn its bag sizes (:meth:`length_per_key`, :meth:`one_id_per_bag`)."""
        if self.values.device.type == "cpu":
            self.length_per_key()
            self.one_id_per_bag()
        other._length_per_key, other._one_id = self._length_per_key, self._one_id
        return other

    def split_by_key(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{key: (values, lengths)}`` views."""
        b = self.batch_size
        out = {}
        vals = torch.split(self.values, self.length_per_key())
        for i, k in enumerate(self.keys):
            out[k] = (vals[i], self.lengths[i * b : (i + 1) * b])
        return out

    def select_keys(self, keys: list[str]) -> KeyedJagged:
        parts = self.split_by_key()
        return KeyedJagged.from_lengths_per_key(
            keys, [parts[k][0] for k in keys], [parts[k][1] for k in keys]
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KeyedJagged:
        """This batch on ``device``, with its host-side facts (:meth:`_with_facts`)."""
        return self._with_facts(KeyedJagged(
            self.keys,
            self.values.to(device, non_blocking=non_blocking),
            self.lengths.to(device, non_blocking=non_blocking),
        ))

    def pin_memory(self) -> KeyedJagged:
        return self._with_facts(KeyedJagged(self.keys, self.values.pin_memory(), self.lengths.pin_memory()))

    def __repr__(self) -> str:
        return (
            f"KeyedJagged(keys={self.keys}, batch_size={self.batch_size}, "
            f"nnz={self.values.numel()})"
        )


@dataclass
class Batch:
    """One rank's training batch.

    Attributes:
        dense: float32 ``[B, n_dense]`` (already normalized, e.g. log(x+1)).
        sparse: the categorical ids, :class:`KeyedJagged` with ``B`` samples.
        labels: float32 ``[B]`` of 0/1 clicks.
    """

    dense: torch.Tensor
    sparse: KeyedJagged
    labels: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.labels.numel()

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(
            self.dense.to(device, non_blocking=non_blocking),
            self.sparse.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> Batch:
        """A copy in page-locked memory, for a non-blocking copy to a GPU."""
        return Batch(self.dense.pin_memory(), self.sparse.pin_memory(), self.labels.pin_memory())
