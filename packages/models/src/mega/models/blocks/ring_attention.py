"""Ring attention (``--cp-comm-type p2p``): key/value blocks travel round the context group.

Each rank holds the queries, keys and values of its two sequence chunks (``i`` and
``2 * cp - 1 - i``, :mod:`mega.core.parallel.context_parallel`). In ``cp`` steps every rank's
keys and values visit every rank: while one block is attended to, the next is already being
sent on (``isend``/``irecv`` to the neighbours), and each block's output is merged into the
running result by the online-softmax rule, so no rank ever holds more than two blocks.

With a causal mask, the load-balanced layout makes every block after the rank's own one half a
block of work, and the other half wholly masked (skipped, never computed):

* step 0, the rank's own keys: causal over both chunks (they are in sequence order);
* keys of a lower rank ``j < i``: its first chunk (``j``) precedes both of ours and its second
  (``2cp-1-j``) follows both: all queries against the first half of the keys, unmasked;
* keys of a higher rank ``j > i``: both its chunks precede our second chunk and follow our first:
  the second half of the queries against all the keys, unmasked.

The backward runs the ring again with the forward's final output and log-sum-exp (the
``block_attention`` kernel contract, flash-attention's convention): each rank adds its share of
the gradient of the keys and values it is visiting to an accumulator that travels one step behind
them and comes home after the last step. The blocks' attention comes from the selected
``block_attention`` kernel, so any backend that fills that contract runs here.

Rows of several documents (:mod:`mega.core.parallel.document_chunks`) attend block by block
under a mask instead: a query sees the visiting keys of its own document that are not after it.
The mask comes from the rows' layout, known on every rank, so the keys travel alone; the kernel
must take masks (``takes_mask``). Rows split per document (packed rows) skip no block: the hidden
half of each block is scattered over the documents, so it is masked, not cut out. Rows split the
ordinary way (GPT data's ``--reset-attention-mask``) skip the hidden halves as above and mask the
rest by document.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mega.core.parallel.collectives import active_counter
from mega.core.parallel.groups import Group
from mega.models.blocks.chunk_layout import ChunkLayout


class RingExchange:
    """Send a tensor to the next rank of the group and receive the previous rank's, in the
    background; ``tag`` keeps two exchanges in flight at once apart."""

    def __init__(self, group: Group, tag: int = 0):
        self.group, self.tag = group, tag
        self.next = group.ranks[(group.rank + 1) % group.size]
        self.previous = group.ranks[(group.rank - 1) % group.size]

    def start(self, tensor: torch.Tensor) -> _Pending:
        if self.group.size <= 1:  # a ring of one: what goes round comes straight back
            return _Pending([], tensor, tensor)
        tensor = tensor.contiguous()
        received = torch.empty_like(tensor)
        counter = active_counter()
        if counter is not None:
            counter.record("send", self.group, tensor)
        operations = [dist.P2POp(dist.isend, tensor, self.next, self.group.group, self.tag),
                      dist.P2POp(dist.irecv, received, self.previous, self.group.group, self.tag)]
        return _Pending(dist.batch_isend_irecv(operations), received, tensor)


class _Pending:
    def __init__(self, works, received: torch.Tensor, sent: torch.Tensor):
        self.works, self.received, self.sent = works, received, sent  # ``sent`` lives until done

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.received


def visible_block(step: int, rank: int, size: int, causal: bool, num_queries: int,
                  num_keys: int) -> tuple[slice, slice, bool]:
    """At ``step`` of the ring (visiting the keys of rank ``rank - step``): which queries, which
    keys and whether the causal mask applies; the rest of the block is wholly masked."""
    everything = slice(None)
    if not causal:
        return everything, everything, False
    if step == 0:
        return everything, everything, True
    source = (rank - step) % size
    if source < rank:
        return everything, slice(0, num_keys // 2), False
    return slice(num_queries // 2, None), everything, False


def _block(step: int, rank: int, size: int, causal: bool, num_queries: int, num_keys: int,
           documents: ChunkLayout | None) -> tuple[slice, slice, bool, torch.Tensor | None]:
    """:func:`visible_block`, or for rows of several documents the documents' mask over every
    query and key (rows split per document) or over the causally visible part (the ordinary split)."""
    if documents is None:
        return *visible_block(step, rank, size, causal, num_queries, num_keys), None
    everything = slice(None)
    rows, columns = everything, everything
    if documents.sequence_chunks:
        rows, columns, _ = visible_block(step, rank, size, causal, num_queries, num_keys)
    return rows, columns, False, documents.mask(rank, (rank - step) % size, causal)[:, :, rows, columns]


def _masked(mask: torch.Tensor | None) -> dict:
    """The kernel's ``mask`` argument where there is one (kernels without masks are not given it)."""
    return {} if mask is None else {"mask": mask}


def _wide(dtype: torch.dtype) -> torch.dtype:
    """Merge and accumulate in fp32, or wider when the inputs are (fp64 in tests)."""
    return torch.promote_types(dtype, torch.float32)


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Online softmax: fold a block's output and log-sum-exp into the running ones (in place)."""
    merged = torch.logaddexp(lse, block_lse.to(lse.dtype))
    out.mul_(torch.exp(lse - merged).unsqueeze(-1))
    out.add_(block_out.to(out.dtype) * torch.exp(block_lse.to(lse.dtype) - merged).unsqueeze(-1))
    lse.copy_(merged)


class RingAttention(torch.autograd.Function):
    """``[batch, heads, seq, head_dim]`` queries (key/value may have fewer heads) of this rank's
    chunks against every rank's keys and values; the output of this rank's queries."""

    @staticmethod
    def forward(ctx, query, key, value, group: Group, kernel, causal: bool, softmax_scale: float,
                documents: ChunkLayout | None = None):
        size, rank = group.size, group.rank
        num_queries, num_keys = query.shape[2], key.shape[2]
        ring = RingExchange(group)
        key_value = torch.stack([key, value])
        out = lse = None
        for step in range(size):
            pending = ring.start(key_value) if step < size - 1 else None
            rows, columns, masked, mask = _block(step, rank, size, causal, num_queries, num_keys, documents)
            block_out, block_lse = kernel.forward(query[:, :, rows], key_value[0][:, :, columns],
                                                  key_value[1][:, :, columns], causal=masked,
                                                  softmax_scale=softmax_scale, **_masked(mask))
            if out is None:  # step 0 covers every query
                out = block_out.to(_wide(query.dtype)).clone()
                lse = block_lse.to(_wide(block_lse.dtype)).clone()
            else:
                _merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
            if pending is not None:
                key_value = pending.wait()
        out = out.to(query.dtype)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.group, ctx.kernel, ctx.causal, ctx.softmax_scale = group, kernel, causal, softmax_scale
        ctx.documents = documents
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        group, kernel = ctx.group, ctx.kernel
        size, rank = group.size, group.rank
        num_queries, num_keys = query.shape[2], key.shape[2]
        key_values, gradients = RingExchange(group, tag=0), RingExchange(group, tag=1)
        key_value = torch.stack([key, value])
        grad_query = torch.zeros(query.shape, dtype=_wide(query.dtype), device=query.device)
        grad_pending = None
        for step in range(size):
            pending = key_values.start(key_value) if step < size - 1 else None
            rows, columns, masked, mask = _block(step, rank, size, ctx.causal, num_queries, num_keys,
                                                 ctx.documents)
            dq, dk, dv = kernel.backward(grad_out[:, :, rows], query[:, :, rows], key_value[0][:, :, columns],
                                         key_value[1][:, :, columns], out[:, :, rows], lse[:, :, rows],
                                         causal=masked, softmax_scale=ctx.softmax_scale, **_masked(mask))
            grad_query[:, :, rows] += dq
            # The gradient of the keys and values being visited: what the ranks before added, plus ours.
            if grad_pending is None:
                grad_key_value = torch.zeros(key_value.shape, dtype=_wide(key.dtype), device=key.device)
            else:
                grad_key_value = grad_pending.wait()
            grad_key_value[0][:, :, columns] += dk
            grad_key_value[1][:, :, columns] += dv
            grad_pending = gradients.start(grad_key_value)  # on to the rank that visits them next
            if pending is not None:
                key_value = pending.wait()
        grad_key_value = grad_pending.wait()  # our own keys' and values', back from their tour
        return (grad_query.to(query.dtype), grad_key_value[0].to(key.dtype), grad_key_value[1].to(value.dtype),
                None, None, None, None, None)


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: Group, kernel, *,
                   causal: bool, softmax_scale: float, documents: ChunkLayout | None = None) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence's keys (see the module docstring);
    ``documents``: packed rows, each query within its own document."""
    return RingAttention.apply(query, key, value, group, kernel, causal, softmax_scale, documents)
