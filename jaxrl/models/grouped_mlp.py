"""Routed SwiGLU experts over token-slots sorted by expert: the grouped forms of the dropless dispatch.

Shape letters as in `moe.py`; M rows of the padded block layout, J blocks of `block` rows.

`ragged_swiglu` uses `lax.ragged_dot` (a real grouped GEMM on GPU/TPU; XLA:CPU computes every group
densely, E times the work). `blocked_swiglu` is the CPU form: every expert's group of slots is padded
to whole blocks, and one loop walks only the blocks in use, each running the whole expert MLP
(gate, up, SiLU, down) on its rows with its expert's weights. Its backward is written by hand as the
same kind of loop (input gradient per block, weight gradients accumulated into the block's expert),
so neither direction gathers per-block weight copies, scatters them back, or computes a pad block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax


def ragged_swiglu(x_SxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, sizes_E):
    """Sorted slots x_SxD (expert groups contiguous, sizes_E rows each) -> y_SxD."""
    h_SxF = jax.nn.silu(lax.ragged_dot(x_SxD, w_gate_ExDxF, sizes_E)) * lax.ragged_dot(x_SxD, w_up_ExDxF, sizes_E)
    return lax.ragged_dot(h_SxF, w_down_ExFxD, sizes_E)


def block_layout(sizes_E, n_slots: int, block: int):
    """Pad every expert group of the sorted slots to a multiple of `block` rows.

    -> (row_M: the sorted slot each padded row holds, n_slots for a pad row; row_of_slot_S: the padded
    row of each sorted slot; expert_J: the expert of each block; n_used: how many blocks hold slots,
    all before any unused one). Static M = J * block with J = ceil(n_slots / block) + E, enough for
    any group sizes. Sorted slots past the groups (sizes_E summing to less than n_slots: slots no
    expert runs) get row M, i.e. no row."""
    E = sizes_E.shape[0]
    J = -(-n_slots // block) + E
    blocks_E = (sizes_E + block - 1) // block
    pad_end_E = jnp.cumsum(blocks_E * block)
    pad_start_E, start_E = pad_end_E - blocks_E * block, jnp.cumsum(sizes_E) - sizes_E
    slot_S = jnp.arange(n_slots)
    ends_E = jnp.cumsum(sizes_E)
    expert_S = jnp.searchsorted(ends_E, slot_S, side="right")  # sorted slots: groups are contiguous
    row_of_slot_S = (pad_start_E[expert_S] + slot_S - start_E[expert_S]).astype(jnp.int32)
    row_of_slot_S = jnp.where(slot_S < ends_E[-1], row_of_slot_S, J * block)  # the scatter below drops row M
    row_M = jnp.full((J * block,), n_slots, jnp.int32).at[row_of_slot_S].set(slot_S.astype(jnp.int32))
    expert_J = jnp.minimum(jnp.searchsorted(pad_end_E, jnp.arange(J) * block, side="right"), E - 1)
    return row_M, row_of_slot_S, expert_J.astype(jnp.int32), jnp.sum(blocks_E)


def _rows(a_MxX, j, block: int):
    return lax.dynamic_slice_in_dim(a_MxX, j * block, block)


def _put_rows(a_MxX, v_bxX, j, block: int):
    return lax.dynamic_update_slice_in_dim(a_MxX, v_bxX, j * block, 0)


def _forward(x_MxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, expert_J, n_used, block: int):
    """-> (y_MxD, gate_MxF, up_MxF): the pre-activations are kept for the backward. Rows of unused
    blocks stay 0."""
    M, F = x_MxD.shape[0], w_gate_ExDxF.shape[2]

    def body(j, carry):
        y_MxD, g_MxF, u_MxF = carry
        e = expert_J[j]
        x_bxD = _rows(x_MxD, j, block)
        g_bxF, u_bxF = x_bxD @ w_gate_ExDxF[e], x_bxD @ w_up_ExDxF[e]
        y_bxD = (jax.nn.silu(g_bxF) * u_bxF) @ w_down_ExFxD[e]
        return (_put_rows(y_MxD, y_bxD, j, block), _put_rows(g_MxF, g_bxF, j, block), _put_rows(u_MxF, u_bxF, j, block))

    vma = _vma(x_MxD)
    zeros = _varying(
        vma, jnp.zeros((M, x_MxD.shape[1]), x_MxD.dtype), jnp.zeros((M, F), x_MxD.dtype), jnp.zeros((M, F), x_MxD.dtype)
    )
    return lax.fori_loop(0, n_used, body, zeros)


def _vma(a) -> frozenset:
    """The shard_map manual axes `a` varies over (empty outside shard_map)."""
    return jax.typeof(a).manual_axis_type.varying


def _varying(vma, *arrays):
    """Under shard_map, make every array vary over the manual axes `vma` (a loop carry must keep one
    type; the transpose of this cast sums the gradient over the axes it added)."""
    return tuple(lax.pcast(a, tuple(sorted(vma - _vma(a))), to="varying") if vma - _vma(a) else a for a in arrays)


def blocked_swiglu(x_MxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, expert_J, n_used, block: int):
    """Padded block rows x_MxD (layout of `block_layout`) -> y_MxD; block j uses expert expert_J[j],
    blocks n_used.. are skipped (their rows give 0)."""
    arrays = (x_MxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD)
    vma = frozenset().union(*(_vma(a) for a in arrays + (expert_J, n_used)))
    return _blocked_swiglu(*_varying(vma, *arrays), *_varying(vma, expert_J, n_used), block)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _blocked_swiglu(x_MxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, expert_J, n_used, block: int):
    return _forward(x_MxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, expert_J, n_used, block)[0]


def _blocked_fwd(x_MxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, expert_J, n_used, block):
    y_MxD, g_MxF, u_MxF = _forward(x_MxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, expert_J, n_used, block)
    return y_MxD, (x_MxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, expert_J, n_used, g_MxF, u_MxF)


def _blocked_bwd(block, residuals, dy_MxD):
    x_MxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, expert_J, n_used, g_MxF, u_MxF = residuals

    def body(j, carry):
        dx_MxD, dw_gate, dw_up, dw_down = carry
        e = expert_J[j]
        x_bxD, g_bxF, u_bxF, dy_bxD = (_rows(a, j, block) for a in (x_MxD, g_MxF, u_MxF, dy_MxD))
        sig_bxF = jax.nn.sigmoid(g_bxF)
        silu_bxF = g_bxF * sig_bxF
        dh_bxF = dy_bxD @ w_down_ExFxD[e].T
        du_bxF = dh_bxF * silu_bxF
        dg_bxF = dh_bxF * u_bxF * sig_bxF * (1 + g_bxF * (1 - sig_bxF))  # d silu(g) / dg
        dx_bxD = dg_bxF @ w_gate_ExDxF[e].T + du_bxF @ w_up_ExDxF[e].T
        return (
            _put_rows(dx_MxD, dx_bxD, j, block),
            dw_gate.at[e].add(x_bxD.T @ dg_bxF),
            dw_up.at[e].add(x_bxD.T @ du_bxF),
            dw_down.at[e].add((silu_bxF * u_bxF).T @ dy_bxD),
        )

    zeros = _varying(
        _vma(x_MxD), *(jnp.zeros(a.shape, a.dtype) for a in (x_MxD, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD))
    )
    dx_MxD, dw_gate, dw_up, dw_down = lax.fori_loop(0, n_used, body, zeros)
    return dx_MxD, dw_gate, dw_up, dw_down, None, None


_blocked_swiglu.defvjp(_blocked_fwd, _blocked_bwd)


@jax.custom_vjp
def gather_rows(x_AxD, src_B, inverse_AxR):
    """y_BxD = x_AxD[src_B] (src A: a zero row), for an index map whose inverse is known: row a of x
    is read by the rows inverse_AxR[a] of y (B: none). The backward is then a gather and a sum over R
    instead of a scatter-add, which XLA:CPU runs element by element."""
    return jnp.take(jnp.concatenate([x_AxD, jnp.zeros_like(x_AxD[:1])]), src_B, axis=0)


def _gather_fwd(x_AxD, src_B, inverse_AxR):
    return gather_rows(x_AxD, src_B, inverse_AxR), inverse_AxR


def _gather_bwd(inverse_AxR, dy_BxD):
    dx_AxRxD = jnp.take(jnp.concatenate([dy_BxD, jnp.zeros_like(dy_BxD[:1])]), inverse_AxR, axis=0)
    return jnp.sum(dx_AxRxD, axis=1), None, None


gather_rows.defvjp(_gather_fwd, _gather_bwd)
