"""Attention across the context group equals whole-sequence attention, forward and backward.

The reference is torch's own attention (``scaled_dot_product_attention`` with autograd) on the
whole sequence in fp64; each comm type (ring ``p2p``, ``all_gather``, Ulysses ``a2a``) runs on
the load-balanced chunks of a 4-rank gloo world split as cp4 and as cp2 (x dp2), with a causal
and a full mask, grouped-query heads (GQA) included, and on packed rows (several documents per
row, split per document; the reference: torch's attention under the dense per-document causal
mask). Outputs and the gradients of queries, keys and values must agree within 1e-6 (relative to
the largest entry). One world serves every case.

Also: the byte count of the ring's sends (the benchmark's formula) and the chunk bookkeeping.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mega.core.parallel.context_parallel import (
    held_chunks,
    split_batch,
    split_sequence,
    to_rank_order,
    to_sequence_order,
)
from mega.core.parallel.document_chunks import document_chunk_index
from mega.core.parallel.groups import Group
from mega.models.blocks.chunk_layout import DocumentChunks, SequenceChunks, chunk_layout
from mega.models.blocks.context_attention import context_parallel_attention
from mega.models.blocks.ring_attention import visible_block

BATCH, HEADS, KV_HEADS, SEQ, DIM = 2, 4, 2, 16, 8
# Packed rows per context size: documents' lengths, multiples of 2 x cp, the rows' last the padding.
DOCUMENTS = {4: [[8, 8], [16]], 2: [[4, 8, 4], [12, 4]]}
# Documents of any length (GPT data's --reset-attention-mask), one crossing every chunk boundary.
ANY_LENGTH = [[3, 5, 1, 7], [10, 1, 5]]


def _document_ids(rows) -> torch.Tensor:
    return torch.tensor([[number for number, length in enumerate(row) for _ in range(length)] for row in rows])


def _cu_seqlens(document_ids: torch.Tensor) -> torch.Tensor:
    """The documents of the rows laid end to end (what the model's packed mask carries)."""
    lengths = [int(n) for row in document_ids for n in torch.unique_consecutive(row, return_counts=True)[1]]
    return torch.tensor([0] + lengths).cumsum(0).to(torch.int32)


def _whole_sequence_case(causal: bool, document_ids: torch.Tensor | None = None):
    """Inputs, upstream gradient, and torch's attention output and gradients for the whole sequence."""
    generator = torch.Generator().manual_seed(11)
    def draw(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)
    query, key, value = draw(BATCH, HEADS, SEQ, DIM), draw(BATCH, KV_HEADS, SEQ, DIM), draw(BATCH, KV_HEADS, SEQ, DIM)
    grad_out = draw(BATCH, HEADS, SEQ, DIM)
    leaves = [t.clone().requires_grad_() for t in (query, key, value)]
    repeats = HEADS // KV_HEADS
    mask = None
    if document_ids is not None:  # each query within its own document, causally
        mask = (document_ids[:, :, None] == document_ids[:, None, :]) & torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
        mask = mask[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        leaves[0], leaves[1].repeat_interleave(repeats, 1), leaves[2].repeat_interleave(repeats, 1),
        attn_mask=mask, is_causal=causal and mask is None, scale=0.3)
    out.backward(grad_out)
    return (query, key, value, grad_out), (out.detach(), *(leaf.grad for leaf in leaves))


def _relative_error(actual, expected):
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def attention_errors(cp: int) -> dict:
    """On every rank of the world: the largest relative error of output and gradients per case."""
    from mega.core.kernels import Kernels
    from mega.core.parallel import ParallelConfig, ParallelGroups
    from mega.core.parallel.collectives import CommCounter
    from mega.models.blocks.context_attention import context_parallel_attention

    groups = ParallelGroups(ParallelConfig(cp=cp))
    errors = {}
    for causal in (True, False):
        inputs, expected = _whole_sequence_case(causal)
        for comm_type in ("p2p", "all_gather", "a2a"):
            local = [split_sequence(t, groups.cp, dim=2).requires_grad_() for t in inputs[:3]]
            with CommCounter() as counts:
                out = context_parallel_attention(*local, groups.cp, comm_type, Kernels(), causal=causal,
                                                 softmax_scale=0.3)
                out.backward(split_sequence(inputs[3], groups.cp, dim=2))
            got = [out.detach()] + [t.grad for t in local]
            want = [split_sequence(t, groups.cp, dim=2) for t in expected]
            errors[(causal, comm_type)] = max(_relative_error(g, w) for g, w in zip(got, want, strict=True))
            if comm_type == "p2p":
                errors[("sent bytes", causal)] = counts.summary().get("send/cp", {}).get("bytes", 0)
    errors.update(packed_attention_errors(groups))
    return errors


def packed_attention_errors(groups) -> dict:
    """Rows of several documents, each comm type against the whole rows' per-document attention:
    packed rows split per document, and documents of any length (GPT data's --reset-attention-mask)
    split the ordinary way, the whole rows' document ids on every rank."""
    from mega.core.kernels import Kernels
    from mega.models.blocks.context_attention import context_parallel_attention

    size = groups.cp.size
    per_document = _document_ids(DOCUMENTS[size])
    held = document_chunk_index(per_document, groups.cp.rank, size)
    any_length = _document_ids(ANY_LENGTH)
    ordinary = split_sequence(torch.arange(SEQ).expand(BATCH, SEQ), groups.cp, dim=1)
    cases = {"packed": (per_document, held, chunk_layout(_cu_seqlens(torch.take_along_dim(per_document, held, 1)),
                                                         BATCH, SEQ // size, size)),
             "any length": (any_length, ordinary, chunk_layout(_cu_seqlens(any_length), BATCH, SEQ // size, size))}
    errors = {}
    for name, (document_ids, places, documents) in cases.items():
        inputs, expected = _whole_sequence_case(True, document_ids)

        def mine(tensor, places=places):
            return torch.take_along_dim(tensor, places[:, None, :, None], dim=2)

        for comm_type in ("p2p", "all_gather", "a2a"):
            local = [mine(t).requires_grad_() for t in inputs[:3]]
            out = context_parallel_attention(*local, groups.cp, comm_type, Kernels(), causal=True, softmax_scale=0.3,
                                             documents=documents)
            out.backward(mine(inputs[3]))
            got = [out.detach()] + [t.grad for t in local]
            errors[(name, comm_type)] = max(_relative_error(g, mine(w)) for g, w in zip(got, expected, strict=True))
    return errors


@pytest.mark.parametrize("cp", [4, 2])
def test_attention_across_ranks_matches_whole_sequence(worlds, cp):
    results = worlds.run(4, attention_errors, cp)
    for rank, errors in enumerate(results):
        for case, error in errors.items():
            if case[0] == "sent bytes":
                continue
            causal, comm_type = case
            kind = causal if isinstance(causal, str) else "causal" if causal else "full"
            assert error <= 1e-6, f"cp{cp} rank {rank} {comm_type} {kind}: {error:.3g}"
        # Ring sends per rank: (cp - 1) key/value blocks forward, (cp - 1) again and cp gradient
        # blocks backward, each 2 x batch x kv_heads x seq/cp x head_dim fp64 values.
        block = 2 * BATCH * KV_HEADS * (SEQ // cp) * DIM * 8
        for causal in (True, False):
            assert errors[("sent bytes", causal)] == (3 * cp - 2) * block


def test_visible_blocks_cover_the_causal_mask_once():
    """The ring's blocks, laid over the whole sequence, are exactly the causal mask's allowed pairs."""
    for size in (1, 2, 3, 4):
        seq = 4 * size
        chunk = seq // (2 * size)
        covered = torch.zeros(seq, seq, dtype=torch.long)
        for rank in range(size):
            positions = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in held_chunks(rank, size)])
            for step in range(size):
                source = (rank - step) % size
                key_positions = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in held_chunks(source, size)])
                rows, columns, masked = visible_block(step, rank, size, True, 2 * chunk, 2 * chunk)
                q, k = positions[rows], key_positions[columns]
                allowed = k[None, :] <= q[:, None] if masked else torch.ones(len(q), len(k), dtype=torch.bool)
                assert bool((k[None, :] <= q[:, None])[allowed].all()), "a computed pair is masked"
                covered[q[:, None].expand_as(allowed)[allowed], k[None, :].expand_as(allowed)[allowed]] += 1
        assert torch.equal(covered, torch.ones(seq, seq, dtype=torch.long).tril()), f"cp{size}"


def test_chunk_order_and_batch_split():
    size = 3
    whole = torch.arange(2 * 12).view(2, 12)
    shards = [split_sequence(whole, Group("cp", tuple(range(size)), rank, None), dim=1) for rank in range(size)]
    assert shards[0].tolist()[0] == [0, 1, 10, 11] and shards[2].tolist()[0] == [4, 5, 6, 7]
    assert torch.equal(to_sequence_order(torch.cat(shards, dim=1), size, dim=1), whole)
    assert torch.equal(to_rank_order(whole, size, dim=1), torch.cat(shards, dim=1))
    group = Group("cp", (0, 1, 2), 1, None)
    batch = split_batch({"tokens": whole, "labels": whole + 1, "loss_mask": torch.ones(2, 12)}, group, 12)
    assert batch["tokens"].tolist()[0] == [2, 3, 8, 9]
    assert batch["position_ids"].tolist() == [[2, 3, 8, 9]] * 2  # positions follow the chunks
    assert batch["labels"].tolist()[1] == [15, 16, 21, 22]
    with pytest.raises(ValueError, match="--seq-length 10 must be divisible by 2 x --context-parallel-size = 6"):
        split_batch({"tokens": torch.zeros(1, 10)}, group, 10)


def test_packed_rows_split_per_document():
    """Each rank holds chunks rank and 2cp-1-rank of every document; the layout read back from the
    local rows' cu_seqlens places every rank's tokens where the split took them from."""
    size = 3
    group = Group("cp", (0, 1, 2), 1, None)
    tokens = torch.arange(24).view(2, 12)
    document_ids = _document_ids([[6, 6], [12]])
    positions = torch.tensor([list(range(6)) * 2, list(range(12))])
    batch = split_batch({"tokens": tokens, "document_ids": document_ids, "position_ids": positions,
                         "loss_mask": torch.ones(2, 12)}, group, 12, per_document=True)
    assert batch["tokens"].tolist() == [[1, 4, 7, 10], [14, 15, 20, 21]]
    assert batch["position_ids"].tolist() == [[1, 4, 1, 4], [2, 3, 8, 9]]  # positions travel with the tokens
    assert batch["document_ids"].tolist() == [[0, 0, 1, 1], [0, 0, 0, 0]]
    documents = DocumentChunks.from_cu_seqlens(_cu_seqlens(batch["document_ids"]), 2, 4, size)
    for rank in range(size):
        assert torch.equal(documents.places(rank), document_chunk_index(document_ids, rank, size))
    assert torch.equal(documents.whole_cu_seqlens(), _cu_seqlens(document_ids))
    # The ring and all_gather need a block_attention kernel that takes masks: named where it does not.
    kernels = SimpleNamespace(get=lambda kind: object(), selection={"block_attention": "flash-attn"})
    query = torch.zeros(2, 1, 4, 2)
    with pytest.raises(ValueError, match="--cp-comm-type all_gather need a block_attention kernel that takes "
                                         "masks; --block-attention-backend flash-attn does not"):
        context_parallel_attention(query, query, query, group, "all_gather", kernels, causal=True, softmax_scale=1.0,
                                   documents=documents)
    with pytest.raises(ValueError, match=r"a document of 8 tokens \(row 1 of the micro-batch, from position 0\) "
                                         r"does not cut into 2 x --context-parallel-size = 6 equal chunks"):
        split_batch({"tokens": tokens, "document_ids": _document_ids([[6, 6], [8, 4]])}, group, 12, per_document=True)


def _dense_document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """``[batch, seq, seq]``: each query sees its own document's keys up to itself."""
    seq = document_ids.shape[1]
    return (document_ids[:, :, None] == document_ids[:, None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril()


def test_rows_of_any_documents_split_the_ordinary_way():
    """GPT data's --reset-attention-mask rows: the ordinary chunks (positions with them), the whole
    rows' document ids on every rank; the layout read from the whole rows' cu_seqlens gives every
    pair of ranks the dense per-document causal mask's block, as does the per-document split's."""
    size = 3
    tokens = torch.arange(24).view(2, 12)
    document_ids = _document_ids([[5, 1, 6], [2, 10]])
    positions = torch.tensor([list(range(5)) + [0] + list(range(6)), [0, 1] + list(range(10))])
    batches = [split_batch({"tokens": tokens, "document_ids": document_ids, "position_ids": positions}, Group(
        "cp", (0, 1, 2), rank, None), 12) for rank in range(size)]
    assert batches[1]["tokens"].tolist() == [[2, 3, 8, 9], [14, 15, 20, 21]]
    assert batches[1]["position_ids"].tolist() == [[2, 3, 2, 3], [0, 1, 6, 7]]
    assert all(torch.equal(batch["document_ids"], document_ids) for batch in batches)  # whole rows
    cu_seqlens = _cu_seqlens(document_ids)
    layout = chunk_layout(cu_seqlens, 2, 4, size)
    assert isinstance(layout, SequenceChunks) and torch.equal(layout.whole_cu_seqlens(), _cu_seqlens(document_ids))
    # Every layer of a forward gets the same mask: its layout is made once; another mask's anew.
    assert chunk_layout(cu_seqlens, 2, 4, size) is layout
    assert chunk_layout(cu_seqlens.clone(), 2, 4, size) is not layout
    dense = _dense_document_mask(document_ids)
    for query_rank in range(size):
        query_places = layout.places(query_rank)
        assert torch.equal(torch.take_along_dim(tokens, query_places, 1), batches[query_rank]["tokens"])
        for key_rank in range(size):
            key_places = layout.places(key_rank)
            want = torch.stack([dense[row][query_places[row]][:, key_places[row]] for row in range(2)])
            assert torch.equal(layout.mask(query_rank, key_rank)[:, 0], want), (query_rank, key_rank)
            full = torch.stack([(document_ids[row, query_places[row], None] == document_ids[row, None, key_places[row]])
                                for row in range(2)])
            assert torch.equal(layout.mask(query_rank, key_rank, causal=False)[:, 0], full)
    assert torch.equal(torch.sort(layout.gathered_places(), dim=1).values, torch.arange(12).expand(2, 12))

    packed = _document_ids([[6, 6], [12]])
    local = split_batch({"document_ids": packed}, Group("cp", (0, 1, 2), 0, None), 12, per_document=True)
    per_document = chunk_layout(_cu_seqlens(local["document_ids"]), 2, 4, size)
    assert isinstance(per_document, DocumentChunks)
    dense = _dense_document_mask(packed)
    for query_rank in range(size):
        for key_rank in range(size):
            query_places, key_places = per_document.places(query_rank), per_document.places(key_rank)
            want = torch.stack([dense[row][query_places[row]][:, key_places[row]] for row in range(2)])
            assert torch.equal(per_document.mask(query_rank, key_rank)[:, 0], want)
    with pytest.raises(ValueError, match=r"the packed mask's cu_seqlens span 12 tokens, neither this context rank's "
                                         r"2 x 4 nor the whole rows' 2 x 12"):
        chunk_layout(torch.tensor([0, 12], dtype=torch.int32), 2, 4, size)
