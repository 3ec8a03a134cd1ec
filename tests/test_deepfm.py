"""DeepFM: first-order and FM terms, their sparse gradients, and DES on 2-4 gloo ranks."""

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks

from hybridrec.comm.codecs import make_codec
from hybridrec.comm.ledger import CommLedger
from hybridrec.model.deepfm import DeepFM, fm_terms
from hybridrec.model.embedding import EmbeddingBagCollection, TableConfig
from hybridrec.parallel import plan as P
from hybridrec.parallel.cost_model import predict_step_bytes
from hybridrec.parallel.parallelize import parallelize_dlrm
from hybridrec.sparse.keyed_jagged import Batch, KeyedJagged
from hybridrec.train.loop.sparse_optim import combined_sparse_optimizer
from hybridrec.train.loop.step import sparse_grads

K, GLOBAL_B, STEPS = 4, 12, 3
TABLES = [("t0", 23), ("t1", 40), ("t2", 7)]


def tables():
    return [TableConfig(name=n, num_embeddings=r, embedding_dim=K + 1, features=[f"f_{n}"], fm_cols=K)
            for n, r in TABLES]


def build(zero_top=False):
    """``zero_top``: the deep part's logit is 0 (last layer zero), so its gradient to the
    fields is zero too."""
    torch.manual_seed(0)
    model = DeepFM(num_dense=3, sparse=EmbeddingBagCollection(tables(), seed=7), bottom_mlp=[8, K],
                   top_mlp=[6, 1])
    if zero_top:
        with torch.no_grad():
            model.top.layers[-1].weight.zero_()
            model.top.layers[-1].bias.zero_()
    return model


def global_batches(multi_hot=True, steps=STEPS):
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(steps):
        if multi_hot:
            lengths = torch.randint(0, 4, (len(TABLES), GLOBAL_B), generator=g)  # empty bags too
        else:
            lengths = torch.ones(len(TABLES), GLOBAL_B, dtype=torch.int64)
        vals = [torch.randint(0, r, (int(lengths[i].sum()),), generator=g) for i, (_, r) in enumerate(TABLES)]
        out.append((vals, lengths, torch.randn(GLOBAL_B, 3, generator=g),
                    torch.randint(0, 2, (GLOBAL_B,), generator=g).float()))
    return out


def local_batch(b, lo, hi):
    vals, lengths, dense, labels = b
    vs, ls = [], []
    for i in range(len(TABLES)):
        off = torch.cat([torch.zeros(1, dtype=torch.int64), lengths[i].cumsum(0)])
        vs.append(vals[i][off[lo] : off[hi]])
        ls.append(lengths[i][lo:hi])
    kjt = KeyedJagged.from_lengths_per_key([f"f_{n}" for n, _ in TABLES], vs, ls)
    return Batch(dense[lo:hi], kjt, labels[lo:hi])


def reference_logits(model, weights, batch):
    """DeepFM written out with plain autograd over dense tables (per-id FM)."""
    kjt, b = batch.sparse, batch.labels.shape[0]
    parts = kjt.split_by_key()
    fields, z, q = [], torch.zeros(b), torch.zeros(b)
    for (n, _), w in zip(TABLES, weights):
        ids, lengths = parts[f"f_{n}"]
        bag = torch.repeat_interleave(torch.arange(b), lengths.to(torch.int64))
        rows = w[ids]
        fields.append(torch.zeros(b, K).index_add(0, bag, rows[:, :K]))
        z = z + torch.zeros(b).index_add(0, bag, rows[:, K])
        q = q + torch.zeros(b).index_add(0, bag, rows[:, :K].pow(2).sum(1))
    e = torch.stack(fields, 1)
    deep = model.top(model.interaction(model.bottom(batch.dense), e)).squeeze(1)
    return deep + z + 0.5 * (e.sum(1).pow(2).sum(1) - q)


@pytest.mark.parametrize("multi_hot", [False, True])
def test_sparse_row_gradients_equal_dense_autograd(multi_hot):
    model = build()
    batch = local_batch(global_batches(multi_hot, 1)[0], 0, GLOBAL_B)
    loss = F.binary_cross_entropy_with_logits(model(batch), batch.labels)
    loss.backward()
    got = {}
    for group, ids, rows, _ in model.sparse.pop_sparse_grads():
        full = torch.zeros_like(model.sparse.group_weight(group))
        got[group] = full.index_add_(0, ids, rows)
    weights = [model.sparse.table_weight(n).detach().clone().requires_grad_() for n, _ in TABLES]
    ref = F.binary_cross_entropy_with_logits(reference_logits(model, weights, batch), batch.labels)
    torch.testing.assert_close(loss, ref)
    ref.backward()
    for (n, _), w in zip(TABLES, weights):
        g, start, rows = model.sparse.table_slice(n)
        torch.testing.assert_close(got[g][start : start + rows], w.grad, rtol=1e-5, atol=1e-7)


def make_plan(kind, world):
    tp = {}
    for i, (n, rows) in enumerate(TABLES):
        k = kind if kind != "mixed" else ["row_wise", "column_wise", "data_parallel"][i]
        if k == "table_wise":
            tp[n] = P.table_wise(n, rows, K + 1, i % world)
        elif k == "row_wise":
            tp[n] = P.row_wise(n, rows, K + 1, list(range(world)))
        elif k == "column_wise":  # shards of 3 and 2 columns: the second holds the first-order column
            tp[n] = P.column_wise(n, rows, K + 1, [(i + j) % world for j in range(2)])
        else:
            tp[n] = P.data_parallel(n, rows, K + 1, world)
    plan = P.ShardingPlan(world_size=world, local_world_size=world, tables=tp)
    plan.validate()
    return plan


def train(model, sparse_opts, batches, lo, hi, ledger=None):
    dense_opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    losses = []
    for b in batches:
        batch = local_batch(b, lo, hi)
        loss = F.binary_cross_entropy_with_logits(model(batch), batch.labels)
        dense_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        sparse_opts.step(sparse_grads(model.sparse))
        losses.append(loss.item())
        if ledger is not None:
            ledger.step_end()
    return losses


def worker(topo, kind, sparse_opt):
    ledger = CommLedger()
    model = parallelize_dlrm(build(), make_plan(kind, topo.group_size), topo, ledger=ledger)
    opts = combined_sparse_optimizer(sparse_opt, model.sparse, lr=0.05)
    per = GLOBAL_B // topo.group_size
    losses = train(model, opts, global_batches(), topo.rank * per, (topo.rank + 1) * per, ledger)
    shards = {k: (s, w.detach().clone()) for k, (s, w) in model.sparse.local_shards().items()}
    counted = {d: (ledger.totals(category="output_dist", direction=d).sent // STEPS,
                   ledger.totals(category="output_dist", direction=d).received // STEPS) for d in ("fwd", "bwd")}
    pred = predict_step_bytes(make_plan(kind, topo.group_size), tables(), rank=topo.rank,
                              batch_sizes=[per] * topo.group_size)
    predicted = {d: pred.get(("output_dist", d), (0, 0)) for d in ("fwd", "bwd")}
    matched = {k: v["match"] for k, v in ledger.summary()["predicted_vs_counted"].items()}
    return losses, shards, (counted, predicted, matched), model.sparse.layout.widths


@pytest.mark.distributed
@pytest.mark.parametrize("kind, world, sparse_opt", [
    ("table_wise", 2, "sgd"), ("row_wise", 3, "rowwise_adagrad"), ("column_wise", 2, "sgd"), ("mixed", 4, "sgd"),
])
def test_des_deepfm_equals_single_process(kind, world, sparse_opt):
    results = run_ranks(worker, world, kind, sparse_opt)
    ref = build()
    ref_losses = train(ref, combined_sparse_optimizer(sparse_opt, ref.sparse, lr=0.05), global_batches(), 0, GLOBAL_B)
    mean = [sum(r[0][s] for r in results) / world for s in range(STEPS)]
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for n, rows in TABLES:
        full = torch.full((rows, K + 1), float("nan"))
        for r in results:
            for key, (sh, w) in r[1].items():
                if key.split("@")[0] == n:
                    full[sh.rows[0] : sh.rows[1], sh.cols[0] : sh.cols[1]] = w
        torch.testing.assert_close(full, ref.sparse.table_weight(n), rtol=1e-5, atol=1e-6)
    for r in results:  # the cost model knows the DES layout: predicted == counted
        assert r[2][0] == r[2][1], r[2]
        assert r[2][2] and all(r[2][2].values()), r[2][2]  # and so does every step's prediction
    # DES: an owner sends its pieces' embedding columns plus [z_p, q_p], never the
    # first-order column: K floats per field piece + 2 per owner per sample.
    widths = results[0][3]
    for r, w in enumerate(widths):
        owned = [s for s in make_plan(kind, world).tables.values() for sh in s.shards if sh.rank == r
                 and s.sharding_type != "data_parallel"]
        if owned:
            cols = sum(sh.num_cols - (sh.cols[0] <= K < sh.cols[1])
                       for s in owned for sh in s.shards if sh.rank == r)
            assert w == cols + 2, (r, w, cols)


# -- codecs on the hop: the deep part sees decoded fields, the FM term the true vectors ------
def full_tables(results):
    out = {}
    for n, rows in TABLES:
        full = torch.full((rows, K + 1), float("nan"))
        for r in results:
            for key, (sh, w) in r.items():
                if key.split("@")[0] == n:
                    full[sh.rows[0] : sh.rows[1], sh.cols[0] : sh.cols[1]] = w
        out[n] = full
    return out


def codec_worker(topo, kind, codec_args, steps):
    out = {}
    per = GLOBAL_B // topo.group_size
    for name, codecs in (("plain", {}), ("coded", {n: make_codec("dct", **codec_args) for n, _ in TABLES})):
        plan = make_plan(kind, topo.group_size)
        codecs = {n: c for n, c in codecs.items() if plan.tables[n].sharding_type != "data_parallel"}
        model = parallelize_dlrm(build(zero_top=steps == 1), plan, topo, codecs=codecs)
        opts = combined_sparse_optimizer("sgd", model.sparse, lr=0.05)
        batches = global_batches(steps=steps)
        losses = train(model, opts, batches, topo.rank * per, (topo.rank + 1) * per)
        shards = {k: (s, w.detach().clone()) for k, (s, w) in model.sparse.local_shards().items()}
        out[name] = (losses, shards, {k: v.clone() for k, v in model.state_dict().items()})
    return out


@pytest.mark.distributed
def test_lossless_codec_trains_deepfm_exactly():
    """dct at eta = 1 with float32 values: bit for bit the uncoded hop (owners send s_p
    computed as the receiver would compute it), and the single process's model."""
    results = run_ranks(codec_worker, 2, "mixed", {"eta": 1.0}, STEPS)
    for r in results:
        plain, coded = r["plain"], r["coded"]
        assert plain[0] == coded[0]
        for k in plain[1]:
            assert torch.equal(plain[1][k][1], coded[1][k][1]), k
        for k in plain[2]:
            assert torch.equal(plain[2][k], coded[2][k]), k
    ref = build()
    ref_losses = train(ref, combined_sparse_optimizer("sgd", ref.sparse, lr=0.05), global_batches(), 0, GLOBAL_B)
    mean = [sum(r["coded"][0][s] for r in results) / 2 for s in range(STEPS)]
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for n, full in full_tables([r["coded"][1] for r in results]).items():
        torch.testing.assert_close(full, ref.sparse.table_weight(n), rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
def test_lossy_codec_keeps_the_fm_term_exact():
    """With the deep part's logit zeroed (its gradient to the fields is then zero), one
    step with a lossy codec updates the tables exactly like one process: the first-order
    and FM terms see the true vectors, not the decoded ones."""
    results = run_ranks(codec_worker, 2, "row_wise", {"eta": 0.25}, 1)
    ref = build(zero_top=True)
    train(ref, combined_sparse_optimizer("sgd", ref.sparse, lr=0.05), global_batches(steps=1), 0, GLOBAL_B)
    for n, full in full_tables([r["coded"][1] for r in results]).items():
        torch.testing.assert_close(full, ref.sparse.table_weight(n), rtol=1e-5, atol=1e-6)


def logits_worker(topo, kind):
    per = GLOBAL_B // topo.group_size
    plan = make_plan(kind, topo.group_size)
    codecs = {n: make_codec("dct", eta=0.25) for n, _ in TABLES if plan.tables[n].sharding_type != "data_parallel"}
    model = parallelize_dlrm(build(), plan, topo, codecs=codecs)
    batch = local_batch(global_batches(steps=1)[0], topo.rank * per, (topo.rank + 1) * per)
    with torch.no_grad():
        logits = model(batch)
        kt = model.sparse(batch.sparse)  # the same forward again: what the model saw
        deep = model.top(model.interaction(model.bottom(batch.dense), kt.as_3d())).squeeze(1)
        true_fields, z, q, s = fm_terms(build().sparse(batch.sparse), K)
    return logits, deep, kt.as_3d(), kt.fm, true_fields, z, q, s


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["row_wise", "column_wise"])
def test_lossy_codec_logit_is_deep_of_decoded_plus_true_fm(kind):
    for logits, deep, fields, fm, true_fields, z, q, s in run_ranks(logits_worker, 2, kind):
        assert not torch.allclose(fields, true_fields)  # the codec is lossy
        torch.testing.assert_close(fm, torch.cat([z[:, None], q[:, None], s], 1), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(logits, deep + z + 0.5 * (s.pow(2).sum(1) - q), rtol=1e-5, atol=1e-6)
