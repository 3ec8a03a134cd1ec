#!/usr/bin/env python3
"""The plain-PyTorch reference learner of the defaults sweep: an MLP over embeddings.

It reads a hybridrec dataset directory (the same splits and ids as a ``hybridrec train`` run
on it: the train parts to train, the eval parts for the held-out AUC) and nothing of
hybridrec's training code:

- each dense column standardized with its train mean and std (on top of the dataset's own
  transform, e.g. ``log1p`` of a count: a plain learner's usual preparation);
- one ``nn.Embedding`` per one-hot feature, width ``min(32, round(1.6 * rows ** 0.56))``
  (the rule of thumb of fast.ai's tabular learner), one ``nn.EmbeddingBag(mode="mean")``
  per multi-hot feature, of the same rule;
- the concatenation through ``--hidden`` (256,128) ReLU layers to one logit; Adam
  ``--lr`` (0.001; ``--sparse``: sparse gradients and SparseAdam for the tables, for click
  logs' tables of millions of rows), batch ``--batch`` (256), ``--epochs`` passes, weight decay 0; the AUC
  of the held-out rows after the last epoch (no early stopping on them).

    .venv/bin/python benchmarks/reference_learner.py DATASET --epochs 5 --seed 0
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch
from torch import nn

from hybridrec.data.schema import DatasetMeta
from hybridrec.metrics.classification import auc as roc_auc


def load(meta: DatasetMeta, split: str):
    parts = meta.split_parts(split)
    dense = np.concatenate([np.load(meta.part_dir(p.name) / "dense.npy") for p in parts])
    labels = np.concatenate([np.load(meta.part_dir(p.name) / "labels.npy") for p in parts]).astype(np.float32)
    onehot = np.concatenate([np.load(meta.part_dir(p.name) / "onehot.npy") for p in parts]).astype(np.int64)
    bags = {}
    for f in meta.schema.multihot:
        vals, offs = [], []
        base = 0
        for p in parts:
            v = np.load(meta.part_dir(p.name) / f"mh-{f.name}.values.npy").astype(np.int64)
            o = np.load(meta.part_dir(p.name) / f"mh-{f.name}.offsets.npy").astype(np.int64)
            vals.append(v)
            offs.append(o[:-1] + base)
            base += len(v)
        bags[f.name] = (np.concatenate(vals), np.concatenate([*offs, [base]]))
    return dense.astype(np.float32), onehot, bags, labels


def width(rows: int) -> int:
    return min(32, max(1, round(1.6 * rows ** 0.56)))


class Reference(nn.Module):
    def __init__(self, meta: DatasetMeta, n_dense: int, hidden: list[int], *, sparse: bool = False) -> None:
        super().__init__()
        self.onehot = nn.ModuleList(nn.Embedding(f.num_embeddings, width(f.num_embeddings), sparse=sparse)
                                    for f in meta.schema.onehot)
        self.multihot = nn.ModuleList(nn.EmbeddingBag(f.num_embeddings, width(f.num_embeddings), mode="mean",
                                                      sparse=sparse)
                                      for f in meta.schema.multihot)
        n = n_dense + sum(e.embedding_dim for e in self.onehot) + sum(e.embedding_dim for e in self.multihot)
        layers: list[nn.Module] = []
        for h in hidden:
            layers += [nn.Linear(n, h), nn.ReLU()]
            n = h
        self.mlp = nn.Sequential(*layers, nn.Linear(n, 1))

    def forward(self, dense, ids, bags):
        xs = [dense, *(e(ids[:, j]) for j, e in enumerate(self.onehot))]
        xs += [e(v, o) for e, (v, o) in zip(self.multihot, bags)]
        return self.mlp(torch.cat(xs, 1)).squeeze(1)


def batch_bags(bags: dict, names: list[str], rows: np.ndarray):
    out = []
    for n in names:
        values, offsets = bags[n]
        starts, ends = offsets[rows], offsets[rows + 1]
        lengths = ends - starts
        idx = np.repeat(starts - np.cumsum(np.concatenate([[0], lengths[:-1]])), lengths) + np.arange(lengths.sum())
        out.append((torch.from_numpy(values[idx]), torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)[:-1]]))))
    return out


def train(path: str, *, epochs: int, seed: int, lr: float = 1e-3, batch: int = 256,
          hidden: tuple[int, ...] = (256, 128), sparse: bool = False) -> dict:
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    meta = DatasetMeta.load(path)
    xd, xi, xb, y = load(meta, "train")
    ed, ei, eb, ey = load(meta, "eval")
    mean, std = xd.mean(0), xd.std(0)
    std[std == 0] = 1.0
    xd, ed = (xd - mean) / std, (ed - mean) / std
    names = [f.name for f in meta.schema.multihot]
    model = Reference(meta, xd.shape[1], list(hidden), sparse=sparse)
    tables = [*model.onehot.parameters(), *model.multihot.parameters()]
    opts = ([torch.optim.SparseAdam(tables, lr=lr), torch.optim.Adam(model.mlp.parameters(), lr=lr)] if sparse
            else [torch.optim.Adam(model.parameters(), lr=lr)])
    loss_fn = nn.BCEWithLogitsLoss()
    start = time.perf_counter()
    for _ in range(epochs):
        order = rng.permutation(len(y))
        model.train()
        for s in range(0, len(order), batch):
            rows = order[s:s + batch]
            logit = model(torch.from_numpy(xd[rows]), torch.from_numpy(xi[rows]), batch_bags(xb, names, rows))
            loss = loss_fn(logit, torch.from_numpy(y[rows]))
            for opt in opts:
                opt.zero_grad()
            loss.backward()
            for opt in opts:
                opt.step()
    model.eval()
    preds = []
    with torch.no_grad():
        for s in range(0, len(ey), 8192):
            rows = np.arange(s, min(s + 8192, len(ey)))
            preds.append(torch.sigmoid(model(torch.from_numpy(ed[rows]), torch.from_numpy(ei[rows]),
                                             batch_bags(eb, names, rows))).numpy())
    p = np.concatenate(preds)
    return {"auc": float(roc_auc(ey, p)), "epochs": epochs, "seed": seed, "train_rows": len(y),
            "eval_rows": len(ey), "seconds": round(time.perf_counter() - start, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dataset")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--sparse", action="store_true",
                   help="sparse embedding gradients and SparseAdam (lazy Adam) for the tables, Adam for the MLP: "
                        "for tables of millions of rows, where dense Adam updates every row every step")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(json.dumps(train(args.dataset, epochs=args.epochs, seed=args.seed, lr=args.lr, batch=args.batch,
                           sparse=args.sparse)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
