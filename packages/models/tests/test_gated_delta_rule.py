"""The chunked gated delta rule equals the recurrent one, and transformers' torch reference.

CPU, fp32 (tensors made on the CPU whatever the machine). Random normalised queries and keys,
decays ``g <= 0`` and gates ``beta`` in (0, 1), a non-zero initial state: the chunked rule at chunk
sizes 1, 16 and 64 gives the recurrent rule's outputs and final state (1e-5 relative), over a
length that is no multiple of the chunk; right-padded rows of ragged lengths (``beta = g = 0``
past their end, as the generation cache pads prompts) end with the state of their own tokens
alone; and both equal ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule`` of
transformers' Qwen3-Next where it is installed.
"""

from __future__ import annotations

import pytest
import torch

from mega.models.qwen3_next.delta_rule import (
    chunked_gated_delta_rule,
    l2_normalize,
    recurrent_gated_delta_rule,
)

BATCH, HEADS, SEQ, KEY, VALUE = 2, 3, 37, 8, 6


def inputs(seq: int = SEQ, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    query = l2_normalize(randn(BATCH, HEADS, seq, KEY)) * KEY ** -0.5
    key = l2_normalize(randn(BATCH, HEADS, seq, KEY))
    value = randn(BATCH, HEADS, seq, VALUE)
    g = -torch.rand(BATCH, HEADS, seq, generator=generator) * 2
    beta = torch.rand(BATCH, HEADS, seq, generator=generator)
    state = randn(BATCH, HEADS, KEY, VALUE)
    return query, key, value, g, beta, state


@pytest.mark.parametrize("chunk_size", [1, 16, 64])
def test_chunked_equals_recurrent(chunk_size, assert_close):
    args = inputs()
    expected, expected_state = recurrent_gated_delta_rule(*args)
    out, state = chunked_gated_delta_rule(*args, chunk_size=chunk_size)
    assert_close(out, expected, what=f"outputs, chunk {chunk_size}")
    assert_close(state, expected_state, what=f"final state, chunk {chunk_size}")


def test_ragged_rows_keep_their_own_state(assert_close):
    query, key, value, g, beta, state = inputs()
    lengths = torch.tensor([SEQ, 20])
    own = (torch.arange(SEQ)[None, :] < lengths[:, None])[:, None, :]
    out, final = chunked_gated_delta_rule(query, key, value, g * own, beta * own, state, chunk_size=16)
    for row, length in enumerate(lengths.tolist()):
        alone = [t[row:row + 1, :, :length] for t in (query, key, value, g, beta)]
        expected, expected_state = recurrent_gated_delta_rule(*alone, state[row:row + 1])
        assert_close(out[row:row + 1, :, :length], expected, what=f"row {row} outputs")
        assert_close(final[row:row + 1], expected_state, what=f"row {row} final state")


def test_both_equal_transformers_torch_reference(assert_close):
    reference = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    query, key, value, g, beta, state = inputs(seed=1)
    # transformers' functions take [batch, seq, heads, dim], normalise and scale the queries themselves
    as_hf = [t.transpose(1, 2) for t in (query * KEY ** 0.5, key, value, g, beta)]
    for name, ours in (("torch_chunk_gated_delta_rule", chunked_gated_delta_rule),
                       ("torch_recurrent_gated_delta_rule", recurrent_gated_delta_rule)):
        theirs, their_state = getattr(reference, name)(*as_hf[:3], g=as_hf[3], beta=as_hf[4], initial_state=state,
                                                       output_final_state=True, use_qk_l2norm_in_kernel=True)
        out, final = ours(query, key, value, g, beta, state)
        assert_close(out, theirs.transpose(1, 2), what=f"{name} outputs")
        assert_close(final, their_state, what=f"{name} final state")
