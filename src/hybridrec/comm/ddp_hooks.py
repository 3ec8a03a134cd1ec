"""DDP communication hooks that average dense gradients through a compressor, and
count the bytes they put on the wire.

A hook factory is called once per data-parallel module, ``factory(arch, module)``, and
returns that module's hook ``hook(process_group, bucket) -> Future[Tensor]``
(``parallel.parallelize.parallelize_dlrm`` registers it).

Compressor state is keyed by *parameter name* (``"top.layers.0.weight"``), not by bucket
index: DDP rebuilds its buckets after the first step in the order gradients became
ready (a bucket of ``[weight, bias]`` may become ``[bias, weight]``, with other
boundaries), so a residual or threshold per bucket index would be applied to the wrong
entries. Per-parameter keys survive any rebuild unchanged.

Byte accounting (category ``"dense_allreduce"``, direction ``"bwd"``): ``original`` is
what the uncompressed ring all-reduce of the fp32 bucket sends,
``2 (w-1) / w * nbytes`` (the formula of ``allreduce_hook``); ``sent`` and ``received``
are what this hook's own collectives put on and took off the wire (a fixed-size
message's padding included).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from hybridrec.comm import sparse_message as sm
from hybridrec.comm.compress import GradientCompressor
from hybridrec.comm.ledger import CommLedger, ring_allreduce_bytes
from hybridrec.comm.sparse_message import SparseGrad

CommHook = Callable[[dist.ProcessGroup, dist.GradBucket], torch.futures.Future]
HookFactory = Callable[[str, torch.nn.Module], CommHook]
"""``(arch name, the module DDP wraps) -> that module's comm hook``."""

CATEGORY = "dense_allreduce"


def _done(value: torch.Tensor) -> torch.futures.Future:
    fut = torch.futures.Future()
    fut.set_result(value)
    return fut


@dataclass
class _Message:
    """One buffer's encoded sparse message, its size exchange under way."""

    buf: torch.Tensor
    msg: SparseGrad
    encoded: torch.Tensor
    sizes: sm.PendingSizes
    mean: bool
    original: int | None
    out: torch.futures.Future | None = None
    """The future a DDP hook returned for it (completed with ``buf`` once summed)."""


def _summed(buf: torch.Tensor, rank: int, world: int, mean: bool,
            add: Callable[[int], object]) -> torch.Tensor:
    """``buf`` = the sum of every rank's message, ``add(r)`` adding rank ``r``'s into it, in
    rank order on every rank (the replicas stay identical, bit for bit); ``mean``: divided
    by ``world``."""
    buf.zero_()
    for r in range(world):
        add(r)
    return buf.div_(world) if mean else buf


def _settle(out: torch.futures.Future, fut: torch.futures.Future) -> None:
    try:
        out.set_result(fut.value())
    except Exception as e:  # noqa: BLE001 - handed to whoever waits on ``out``
        out.set_exception(e)


class CompressedAllReduce:
    """Hook factory: every parameter of a bucket goes through ``compressor``; the bucket
    is then averaged by an all-reduce (dense payloads: warm-up, fp16/bf16 casting, no
    compression) or by exchanging encoded sparse messages (top-k, DCT).

    One instance serves every arch, so ``state_dict`` covers all of them.

    A bounded message (``SparseGrad.capacity``: top-k below ratio 1, DCT with its cap) is
    one step: the hook encodes it in a buffer of fixed size
    (:class:`~hybridrec.comm.sparse_message.FixedLayout`, the same size on every rank),
    starts the exchange of those buffers (``all_to_all_single``, or the pairwise exchange)
    and returns a future that sums them when they are in, as the dense all-reduce does:
    no sizes travel, nothing waits in the hook. The same path in :meth:`reduce` and
    :meth:`sum_sparse`.

    An unbounded sparse message (DCT without a cap or at ratio 1; a bucket is bounded when
    any of its tensors is, a dense payload beside them counting its size) is two steps:
    the message sizes (one int64 per rank pair), then the messages (their splits need the
    sizes, a host read). In a DDP hook (``overlap``) they are spread over two hooks so
    that no hook waits for the peers to reach its own bucket: the hook of bucket ``i``
    compresses it and *starts* its size exchange, and returns a future this class
    completes; the hook of bucket ``i + 1`` waits for those sizes (by
    then usually in: the peers started theirs while this rank computed bucket ``i + 1``'s
    gradients), starts bucket ``i``'s messages, then starts bucket ``i + 1``'s sizes; the
    last bucket's hook (``bucket.is_last()``) waits for its own sizes and starts its
    messages. Every collective is issued from a hook, i.e. on the autograd thread, where
    DDP calls the hooks in bucket order: the order of collectives is the same on every
    rank (never from a completion callback, which gloo runs on its own threads). The
    completion of the messages (any thread) decodes them and sums them into the bucket in
    rank order, as the blocking order does: the same compressor state, the same sums, bit
    for bit. :meth:`reduce` (no DDP: ``AllReduceSync``, synchronizers) and
    :meth:`sum_sparse` keep the blocking order (sizes, wait, messages).
    """

    def __init__(self, compressor: GradientCompressor, ledger: CommLedger | None = None, *,
                 category: str = CATEGORY, direction: str = "bwd", pairwise: bool = False,
                 overlap: bool = True) -> None:
        """``category``/``direction``: where the ledger counts the bytes (a synchronizer's
        compressed rounds count as ``sync``). ``pairwise``: sparse messages (and their sizes)
        travel by receive-first isend/irecv (``dist.exchange=pairwise``) instead of
        ``all_to_all_single``; the same bytes, the same sums. ``overlap``: DDP hooks defer
        each bucket's messages to the next bucket's hook (see the class doc); False: each
        hook exchanges sizes and starts its messages at once (the same results)."""
        self.compressor = compressor
        self.ledger = ledger
        self.category, self.direction = category, direction
        self.pairwise = pairwise
        self.overlap = overlap

    def __call__(self, arch: str, module: torch.nn.Module) -> CommHook:
        # id() of a Parameter is stable, and GradBucket.parameters() returns the same objects.
        names = {id(p): f"{arch}.{n}" for n, p in module.named_parameters()}
        waiting: list[_Message] = []  # this module's bucket whose size exchange is under way

        def hook(process_group, bucket):  # no annotations: DDP checks them as objects, not strings
            keys = [names[id(p)] for p in bucket.parameters()]
            if not self.overlap:
                return self.reduce(process_group, bucket.buffer(), keys, bucket.gradients())
            if bucket.index() == 0 and waiting:  # a backward that ended early (an error)
                waiting.pop().out.set_exception(RuntimeError("backward ended before this bucket's messages left"))
            if waiting:  # the previous bucket's sizes: its messages go now, before this bucket's sizes
                self._send_into(process_group, waiting.pop())
            buf = bucket.buffer()
            payload = self._payload(buf, keys, bucket.gradients())
            if isinstance(payload, list):
                return self._dense(process_group, buf, payload)
            if payload.capacity is not None:  # no sizes to wait for: started now, summed in the future
                return self._fixed(process_group, buf, payload)
            m = self._start_sizes(process_group, buf, payload)
            m.out = torch.futures.Future()
            if bucket.is_last():  # no later hook in this backward: DDP waits for every bucket after it
                self._send_into(process_group, m)
            else:
                waiting.append(m)
            return m.out

        return hook

    def _payload(self, buf: torch.Tensor, keys: list[str],
                 grads: list[torch.Tensor]) -> list[torch.Tensor] | SparseGrad:
        """Compresses every tensor of a buffer (updates the compressor's state): the dense
        payloads (all dense, one dtype) or the buffer's one sparse message."""
        payloads = [self.compressor.compress(k, g) for k, g in zip(keys, grads)]
        if all(isinstance(p, torch.Tensor) for p in payloads) and len({p.dtype for p in payloads}) == 1:
            return payloads
        sparse = [p if isinstance(p, SparseGrad) else SparseGrad.from_dense(p.to(buf.dtype)) for p in payloads]
        return SparseGrad.cat(sparse)

    def reduce(self, group: dist.ProcessGroup, buf: torch.Tensor, keys: list[str],
               grads: list[torch.Tensor]) -> torch.futures.Future:
        """Averages ``buf`` (``[n]``, the bucket: ``grads`` are views of it, back to back,
        named ``keys``) over ``group``; the future resolves to ``buf``. A sparse message's
        size exchange is waited for here (a round trip), its bytes travel after return."""
        payload = self._payload(buf, keys, grads)
        if isinstance(payload, list):
            return self._dense(group, buf, payload)
        if payload.capacity is not None:
            return self._fixed(group, buf, payload)
        return self._send(group, self._start_sizes(group, buf, payload))

    def _record(self, sent: int, received: int, buf: torch.Tensor, world: int,
                original: int | None = None) -> None:
        if self.ledger is not None:
            if original is None:
                original = ring_allreduce_bytes(buf.numel() * buf.element_size(), world)
            self.ledger.record(self.category, sent=sent, received=received, direction=self.direction,
                               original=original)

    def _dense(self, group, buf, payloads) -> torch.futures.Future:
        world = group.size()
        flat = torch.cat([p.reshape(-1) for p in payloads])
        wire = ring_allreduce_bytes(flat.numel() * flat.element_size(), world)
        self._record(wire, wire, buf, world)
        flat.div_(world)  # before the sum, as allreduce_hook does (no fp16 overflow)
        fut = dist.all_reduce(flat, group=group, async_op=True).get_future()
        return fut.then(lambda f: buf.copy_(f.value()[0]))

    def sum_sparse(self, group: dist.ProcessGroup, key: str, grad: torch.Tensor, *,
                   original: int | None = None) -> torch.Tensor:
        """The sum over ``group`` of every rank's compressed ``grad`` (``[n]``, compressed under
        ``key``; the compressor must send sparse messages): a blocking exchange of the encoded
        messages, added in rank order (identical on every rank). Replicated tables' gradients,
        which are summed, not averaged. ``original``: the ledger's uncompressed bytes (default:
        a ring all-reduce of ``grad``)."""
        msg = self.compressor.compress(key, grad)
        if not isinstance(msg, SparseGrad):
            msg = SparseGrad.from_dense(msg.to(grad.dtype))
        buf = torch.empty_like(grad.reshape(-1))
        if msg.capacity is not None:
            return self._fixed(group, buf, msg, mean=False, original=original).wait()
        return self._send(group, self._start_sizes(group, buf, msg, mean=False, original=original)).wait()

    def _start_sizes(self, group, buf, msg: SparseGrad, *, mean: bool = True,
                     original: int | None = None) -> _Message:
        encoded = sm.encode(msg)
        return _Message(buf, msg, encoded, sm.start_sizes(encoded.numel(), group, pairwise=self.pairwise),
                        mean, original)

    def _fixed(self, group, buf, msg: SparseGrad, *, mean: bool = True,
               original: int | None = None) -> torch.futures.Future:
        """Starts the exchange of every rank's bounded message in buffers of one fixed size
        (``msg.capacity`` entries); the future resolves to ``buf`` holding their sum in rank
        order (``mean``: the average). Sent and received: ``world - 1`` buffers each way."""
        rank, world = group.rank(), group.size()
        layout = sm.FixedLayout(msg.capacity, msg.numel, msg.values.dtype)
        sizes = [layout.nbytes] * world  # known to every rank: nothing to exchange first
        start = sm.start_pairwise_exchange if self.pairwise else sm.start_exchange
        fut, received = start(layout.encode(msg), sizes, group)
        wire = (world - 1) * layout.nbytes
        self._record(wire, wire, buf, world, original)

        def finish(_):
            others = sm.split_received(received, sizes, rank)
            return _summed(buf, rank, world, mean, lambda r: msg.add_to(buf) if r == rank
                           else layout.add_to(others[r], buf))

        return fut.then(finish)

    def _send(self, group, m: _Message) -> torch.futures.Future:
        """Waits for ``m``'s sizes and starts its messages; the future resolves to ``m.buf``
        holding the sum (``mean``: the average) of every rank's message."""
        rank, world = group.rank(), group.size()
        sizes = m.sizes.wait()
        start = sm.start_pairwise_exchange if self.pairwise else sm.start_exchange
        fut, received = start(m.encoded, sizes, group)
        self._record(*sm.exchange_bytes(sizes, rank), m.buf, world, m.original)
        buf, msg, mean = m.buf, m.msg, m.mean

        def finish(_):
            others = sm.split_received(received, sizes, rank)
            return _summed(buf, rank, world, mean, lambda r: (
                msg if r == rank else sm.decode(others[r], buf.numel(), msg.values.dtype)).add_to(buf))

        return fut.then(finish)

    def _send_into(self, group, m: _Message) -> None:
        """:meth:`_send`, completing the future a hook already returned for ``m``."""
        self._send(group, m).add_done_callback(lambda f: _settle(m.out, f))

    def state_dict(self) -> dict:
        return self.compressor.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.compressor.load_state_dict(state)


def powersgd_bytes(state: PowerSGDState, grads: list[torch.Tensor], world: int) -> tuple[int, int]:
    """``(sent, original)`` of one ``powerSGD_hook`` call on a bucket of ``grads`` (bytes
    per rank; received = sent). Before ``start_powerSGD_iter`` it is one all-reduce of
    the bucket; after, three: the tensors it leaves uncompressed, then all P, then all
    Q. The split mirrors ``powerSGD_hook``: a tensor viewed as ``n x m`` (``m`` = the
    rest of its dims) is compressed to rank ``r = min(n, m, rank)`` when
    ``(n + m) * r * min_compression_rate < n * m``."""
    es = grads[0].element_size() if grads else 4
    total = sum(g.numel() for g in grads)
    original = ring_allreduce_bytes(total * es, world)
    if state.iter < state.start_powerSGD_iter:
        return original, original
    plain = ps = qs = 0
    for g in grads:
        n = g.shape[0] if g.dim() else 1
        m = g.numel() // n
        r = min(n, m, state.matrix_approximation_rank)
        if (n + m) * r * state.min_compression_rate < n * m:
            ps, qs = ps + n * r, qs + m * r
        else:
            plain += g.numel()
    return sum(ring_allreduce_bytes(x * es, world) for x in (plain, ps, qs)), original


class PowerSGDHooks:
    """Hook factory around PyTorch's ``powerSGD_hook``: one ``PowerSGDState`` per arch
    (its error and P/Q memories are keyed by bucket index, which two modules would share).

    ``warmup_steps`` = ``start_powerSGD_iter``: plain all-reduce before it. PyTorch
    requires it > 1 with error feedback or warm start, because DDP rebuilds its buckets
    after the first step and a bucket-indexed error would then be misplaced.
    """

    def __init__(self, *, rank: int = 1, warmup_steps: int = 2, error_feedback: bool = True,
                 min_compression_rate: float = 2, seed: int = 0,
                 ledger: CommLedger | None = None) -> None:
        if rank < 1:
            raise ValueError(f"PowerSGD rank must be >= 1, got {rank}")
        if warmup_steps < 2:
            raise ValueError("PowerSGD needs warmup_steps >= 2 (DDP rebuilds its buckets after step 0)")
        self.rank, self.warmup_steps, self.error_feedback = rank, warmup_steps, error_feedback
        self.min_compression_rate, self.seed, self.ledger = min_compression_rate, seed, ledger
        self.states: dict[str, PowerSGDState] = {}  # by arch

    def __call__(self, arch: str, module: torch.nn.Module) -> CommHook:
        def hook(process_group, bucket):
            state = self.states.get(arch)
            if state is None:  # the group is known only here
                state = self.states[arch] = PowerSGDState(
                    process_group, matrix_approximation_rank=self.rank,
                    start_powerSGD_iter=self.warmup_steps, min_compression_rate=self.min_compression_rate,
                    use_error_feedback=self.error_feedback, random_seed=self.seed)
            if self.ledger is not None:
                sent, original = powersgd_bytes(state, bucket.gradients(), process_group.size())
                self.ledger.record(CATEGORY, sent=sent, received=sent, direction="bwd", original=original)
            fut = powerSGD_hook(state, bucket)
            # Waits here: powerSGD_hook issues its P and Q all-reduces from completion
            # callbacks, which could otherwise interleave with the next bucket's or the
            # embedding all-to-all on another rank in a different order.
            return _done(fut.wait())

        return hook
