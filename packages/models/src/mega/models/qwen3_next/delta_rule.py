"""The gated delta rule (Gated DeltaNet, Yang et al. 2024), in torch: the reference the layers run.

Per value head, a state ``S`` ``[key dim, value dim]`` is decayed, corrected towards the new
value where the key points, and read by the query:

    S_t = exp(g_t) S_{t-1} + k_t d_t^T,   d_t = beta_t (v_t - k_t^T exp(g_t) S_{t-1}),   o_t = S_t^T q_t

:func:`recurrent_gated_delta_rule` runs it token by token (decoding: one token per step).
:func:`chunked_gated_delta_rule` computes the same in chunks of ``chunk_size`` tokens (training and
prefill): within a chunk, with ``G_t`` the cumulative log-decay since the chunk's start and
``S_0`` the state entering it, the deltas ``D`` solve one unit lower-triangular system

    (I + A) D = beta V - (beta exp(G) K) S_0,    A_tj = beta_t (k_t . k_j) exp(G_t - G_j)  (j < t)

and then ``O = (exp(G) Q) S_0 + tril((Q K^T) exp(G_t - G_j)) D`` and
``S_C = exp(G_C) S_0 + (exp(G_C - G) K)^T D``: matrix products instead of a loop over tokens.

Inputs are ``[batch, heads, seq, dim]`` (``g``, ``beta``: ``[batch, heads, seq]``), the queries
and keys already normalised and the queries scaled; the arithmetic is fp32. A position with
``beta = 0`` and ``g = 0`` leaves the state as it was: right-padded rows of ragged lengths end with
their own final state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (flash-linear-attention's l2norm)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _initial(state: torch.Tensor | None, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    if state is not None:
        return state.float()
    batch, heads, _, key_dim = key.shape
    return key.new_zeros(batch, heads, key_dim, value.shape[-1], dtype=torch.float32)


def recurrent_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs ``[batch, heads, seq, value dim]`` (fp32) and the final state ``[batch, heads, key
    dim, value dim]`` (fp32), token by token from ``state`` (zeros when None)."""
    query, key, value, g, beta = (t.float() for t in (query, key, value, g, beta))
    state = _initial(state, key, value)
    outputs = []
    for q_t, k_t, v_t, g_t, beta_t in zip(*(t.unbind(2) for t in (query, key, value, g, beta)), strict=True):
        state = state * g_t.exp()[..., None, None]
        delta = beta_t[..., None] * (v_t - torch.einsum("bhk,bhkv->bhv", k_t, state))
        state = state + k_t[..., :, None] * delta[..., None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q_t, state))
    return torch.stack(outputs, dim=2), state


def chunked_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, state: torch.Tensor | None = None, chunk_size: int = 64
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`recurrent_gated_delta_rule` computes, ``chunk_size`` tokens at a time (the module
    docstring's algebra). The sequence is padded to whole chunks with positions that change nothing."""
    query, key, value, g, beta = (t.float() for t in (query, key, value, g, beta))
    state = _initial(state, key, value)
    seq = query.shape[2]
    pad = -seq % chunk_size
    if pad:
        query, key, value = (F.pad(t, (0, 0, 0, pad)) for t in (query, key, value))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))

    def chunks(t: torch.Tensor) -> torch.Tensor:  # [b, h, s, ...] -> [b, h, chunks, C, ...]
        return t.unflatten(2, (-1, chunk_size))

    query, key, value, g, beta = (chunks(t) for t in (query, key, value, g, beta))
    cumulative = g.cumsum(-1)  # G_t within each chunk
    later = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)
    # exp(G_t - G_j) for j <= t (0 above the diagonal, masked before exp: no overflow)
    decay = (cumulative[..., :, None] - cumulative[..., None, :]).masked_fill(later, float("-inf")).exp()
    key_beta = key * beta[..., None]
    system = (key_beta @ key.transpose(-1, -2)) * decay  # its strict lower triangle is A
    solved_values = torch.linalg.solve_triangular(system, value * beta[..., None], upper=False, unitriangular=True)
    solved_keys = torch.linalg.solve_triangular(system, key_beta * cumulative.exp()[..., None], upper=False,
                                                unitriangular=True)
    within = (query @ key.transpose(-1, -2)) * decay  # causal, the diagonal included
    decayed_query = query * cumulative.exp()[..., None]
    keys_to_end = key * (cumulative[..., -1:] - cumulative).exp()[..., None]  # exp(G_C - G_j) k_j
    chunk_decay = cumulative[..., -1].exp()[..., None, None]  # exp(G_C)
    # One chunk at a time along the state; unbound once (a backward of stacks, not of a zero-filled
    # tensor per chunk and operand).
    outputs = []
    for values_c, keys_c, query_c, within_c, to_end_c, decay_c in zip(
            *(t.unbind(2) for t in (solved_values, solved_keys, decayed_query, within, keys_to_end, chunk_decay)),
            strict=True):
        deltas = values_c - keys_c @ state
        outputs.append(query_c @ state + within_c @ deltas)
        state = state * decay_c + to_end_c.transpose(-1, -2) @ deltas
    return torch.stack(outputs, dim=2).flatten(2, 3)[:, :, :seq], state
