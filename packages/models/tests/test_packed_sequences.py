"""Packed rows (``document_ids``, positions restarting per document): every token of a packed
conversation gets the logits and loss it gets when its conversation runs alone (GPT and LLaMA,
the torch backend, fp32); at tp2 with sequence parallelism (in test_lora.py's world) the loss and
every gradient are one process's; at cp2 (same world, each --cp-comm-type, rows split per
document and the ordinary way) every rank's tokens get the loss they get alone."""

from __future__ import annotations

import os
import sys

import torch

from mega.core.parallel import ParallelConfig

sys.path.insert(0, os.path.dirname(__file__))  # ranks load this file by path
from whole_gradients import whole_gradients  # noqa: E402

FAMILIES = ("gpt", "llama")
SEQ, SEED = 16, 5
# Two rows of documents (lengths), the second ending in padding (its own document).
ROWS = [[7, 5, 4], [9, 3, 4]]
CP_ROWS = [[4, 8, 4], [12, 4]]  # at cp2 every document a multiple of 2 x cp long


def tiny_config(family):
    return family.preset("tiny", vocab_size=256, seq_length=SEQ, hidden_dropout=0.0, attention_dropout=0.0,
                         num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64)


def packed_batch(rows=ROWS):
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 256, (len(rows), SEQ), generator=generator)
    labels = torch.randint(0, 256, (len(rows), SEQ), generator=generator)
    document_ids = torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in rows])
    positions = torch.tensor([[p for n in row for p in range(n)] for row in rows])
    return {"tokens": tokens, "labels": labels, "position_ids": positions, "document_ids": document_ids,
            "loss_mask": torch.ones(len(rows), SEQ)}


def losses_alone(model, batch, rows) -> torch.Tensor:
    """``[rows, SEQ]``: each token's loss when its document runs alone (positions from 0)."""
    losses = torch.zeros(len(rows), SEQ)
    for row, lengths in enumerate(rows):
        start = 0
        for length in lengths:
            alone = model(batch["tokens"][row:row + 1, start:start + length])
            losses[row, start:start + length] = model.loss(alone, batch["labels"][row:row + 1, start:start + length])[0]
            start += length
    return losses


def build(family_name, groups=None, parallel=ParallelConfig()):
    from mega.core.build import build_stage
    from mega.core.plugins import get_plugins

    family = get_plugins().models.get(family_name)
    return family, build_stage(family, tiny_config(family), groups=groups, parallel=parallel, seed=SEED)


def test_packed_documents_equal_each_alone():
    batch = packed_batch()
    for family_name in FAMILIES:
        family, model = build(family_name)
        with torch.no_grad():
            packed = model(batch)["logits"]  # [s, b, V]
            losses = model.loss(packed, batch["labels"])  # [b, s]
            for row, lengths in enumerate(ROWS):
                start = 0
                for length in lengths:
                    alone = model(batch["tokens"][row:row + 1, start:start + length])  # positions 0..n-1
                    torch.testing.assert_close(packed[start:start + length, row], alone[:, 0], rtol=1e-5, atol=1e-5)
                    alone_loss = model.loss(alone, batch["labels"][row:row + 1, start:start + length])
                    torch.testing.assert_close(losses[row, start:start + length], alone_loss[0], rtol=1e-5, atol=1e-5)
                    start += length
            # The mask matters: without it the later documents' logits change.
            unmasked = model({key: value for key, value in batch.items() if key != "document_ids"})["logits"]
            assert not torch.allclose(unmasked[7:], packed[7:], atol=1e-3), family_name


def context_parallel_token_losses(family_name) -> dict:
    """On a 2-rank world at cp2, per --cp-comm-type and split (per document, as the trainer splits
    packed conversations, and the ordinary way with the whole rows' document ids, as it splits GPT
    data's --reset-attention-mask rows): this rank's tokens, their loss and their places in the rows."""
    from mega.core.parallel import ParallelGroups
    from mega.core.parallel.context_parallel import split_batch

    results = {}
    for comm_type in ("p2p", "all_gather", "a2a"):
        parallel = ParallelConfig(cp=2, cp_comm_type=comm_type)
        groups = ParallelGroups(parallel)
        _, model = build(family_name, groups, parallel)
        batch = packed_batch(CP_ROWS)
        batch["places"] = torch.arange(SEQ).expand(len(CP_ROWS), SEQ)
        for per_document in (True, False):
            local = split_batch(batch, groups.cp, SEQ, per_document=per_document)
            with torch.no_grad():
                losses = model.loss(model(local)["logits"], local["labels"])
            results[f"{comm_type} {'per document' if per_document else 'ordinary split'}"] = losses, local["places"]
    return results


def check_context_parallel_token_losses(family_name, ranks) -> None:
    """Every rank's tokens (``context_parallel_token_losses``) have the loss they have alone."""
    _, model = build(family_name)
    with torch.no_grad():
        alone = losses_alone(model, packed_batch(CP_ROWS), CP_ROWS)
    for rank, results in enumerate(ranks):
        for case, (losses, places) in results[family_name, "packed cp2"].items():
            where = f"{family_name} cp2 {case} rank {rank}"
            torch.testing.assert_close(losses, torch.take_along_dim(alone, places, dim=1), rtol=1e-5, atol=1e-5,
                                       msg=lambda text, where=where: f"{where}: {text}")


def loss_and_grads(family_name, groups=None, parallel=ParallelConfig()):
    from mega.core.model_family import LossContext

    family, model = build(family_name, groups, parallel)
    batch = packed_batch()
    tp = groups.tp if groups is not None else None
    loss, _ = family.loss(model(batch), batch, LossContext(model.config, tp, model.kernels))
    loss.backward()
    return loss.detach(), whole_gradients(model.named_parameters(), tp)


def test_packed_attention_equals_each_document_alone():
    """The torch backend attends packed documents one row each (no mask over the whole row): its
    output and gradients equal torch's SDPA over each document alone, causal and bidirectional,
    with fewer key heads than query heads; the tokens after the last offset are one document."""
    import torch.nn.functional as F

    from mega.core.kernels import AttentionMask
    from mega.models.torch_kernels import sdpa_attention

    generator = torch.Generator().manual_seed(0)
    rows = [[5, 9, 3, 1], [10, 8]]  # two rows of 18 tokens
    cu_seqlens = torch.tensor([0, 5, 14, 17, 18, 28], dtype=torch.int32)  # the last 8 tokens: no offset of their own
    for causal in (True, False):
        query = torch.randn(2, 4, 18, 8, generator=generator).requires_grad_()
        key, value = (torch.randn(2, 2, 18, 8, generator=generator).requires_grad_() for _ in range(2))
        out = sdpa_attention(query, key, value, mask=AttentionMask(causal=causal, cu_seqlens=cu_seqlens))
        grad = torch.randn(out.shape, generator=generator)
        got = torch.autograd.grad(out, (query, key, value), grad)
        alone = []
        for row, sizes in enumerate(rows):
            starts = [sum(sizes[:k]) for k in range(len(sizes))]
            pieces = [F.scaled_dot_product_attention(
                query[row:row + 1, :, s:s + n], key[row:row + 1, :, s:s + n].repeat_interleave(2, dim=1),
                value[row:row + 1, :, s:s + n].repeat_interleave(2, dim=1), is_causal=causal)
                for s, n in zip(starts, sizes, strict=True)]
            alone.append(torch.cat(pieces, dim=2))
        alone = torch.cat(alone)
        expected = torch.autograd.grad(alone, (query, key, value), grad)
        torch.testing.assert_close(out, alone, atol=1e-6, rtol=1e-5)
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
