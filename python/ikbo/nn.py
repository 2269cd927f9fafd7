"""PyTorch layers that take user tensors at U rows and broadcast inside the kernel.

For models written anew: each layer holds its parameters as torch's own layer
does (same names, shapes and initialization, so state dicts load either way)
and takes the user-side input at its natural batch size U plus
``cand_to_user [B]``, where the torch layer would need it replicated to the B
candidates first. The forward passes run ``torch.ops.ikbo`` operators
(:mod:`ikbo.torch_ops`), so the layers work under ``torch.compile`` (also
``fullgraph=True`` and dynamic shapes), ``torch.export`` and CUDA graphs,
and like those operators they are inference-only (no backward).

- :class:`LCE`: ``torch.matmul(weight, torch.cat([e_u[cand_to_user], e_c], 1))``;
- :class:`Linear`: ``nn.Linear`` over ``torch.cat([x_u[cand_to_user], x_c], -1)``;
- :class:`MultiheadAttention`: batch-first ``nn.MultiheadAttention`` of the
  candidates' queries onto their user's keys and values (dense ``[U, S, ·]``,
  or jagged rows with offsets), its K/V projections run once per user.

Every forward takes ``levels`` too, for requests of more levels (user ->
vendor -> candidate): ``cand_to_user`` then maps the candidates to the groups
of ``levels[0]``, and each level's index maps its groups to the next level's,
up to the users (:func:`ikbo.torch_ops.candidate_map`).

Models written the replicate-then-compute way need no change: ``ikbo.rewrite``
turns them into these operators.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from . import torch_ops  # noqa: F401 -- registers the torch.ops.ikbo operators

__all__ = ["LCE", "Linear", "MultiheadAttention"]

_ikbo = torch.ops.ikbo
_HEAD_DIMS = (64, 128, 256)


def _positive(**sizes: int) -> None:
    for name, size in sizes.items():
        if type(size) is not int or size < 1:
            raise ValueError(f"{name} must be a positive int, got {size!r}")


class LCE(nn.Module):
    """``out[b] = weight @ cat([e_u[cand_to_user[b]], e_c[b]])``: M compressed
    embeddings of each candidate from its user's Ku embeddings and its own Kc.

    ``weight [M, Ku + Kc]``, user columns first, initialized as ``nn.Linear``
    initializes a weight of fan-in Ku + Kc. Forward: ``e_u [U, Ku, N]``,
    ``e_c [B, Kc, N]``, ``cand_to_user [B]`` -> ``[B, M, N]``; the user product
    runs once per user.
    """

    def __init__(
        self,
        user_embeddings: int,
        candidate_embeddings: int,
        compressed_embeddings: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _positive(
            user_embeddings=user_embeddings,
            candidate_embeddings=candidate_embeddings,
            compressed_embeddings=compressed_embeddings,
        )
        self.user_embeddings = user_embeddings
        self.candidate_embeddings = candidate_embeddings
        self.weight = nn.Parameter(
            torch.empty(
                compressed_embeddings,
                user_embeddings + candidate_embeddings,
                device=device,
                dtype=dtype,
            )
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(
        self,
        e_u: torch.Tensor,
        e_c: torch.Tensor,
        cand_to_user: torch.Tensor,
        levels: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        ku = self.user_embeddings
        return _ikbo.lce(self.weight[:, ku:], self.weight[:, :ku], e_c, e_u, cand_to_user, levels)

    def extra_repr(self) -> str:
        return (
            f"user_embeddings={self.user_embeddings}, "
            f"candidate_embeddings={self.candidate_embeddings}, "
            f"compressed_embeddings={self.weight.shape[0]}"
        )


class Linear(nn.Module):
    """``nn.Linear(Fu + Fc, out_features)`` over ``cat([x_u[cand_to_user], x_c], -1)``.

    ``weight [out_features, Fu + Fc]`` (user columns first) and ``bias``, named
    and initialized as ``nn.Linear``'s. Forward: ``x_u [U, Fu]``,
    ``x_c [B, Fc]``, ``cand_to_user [B]`` -> ``[B, out_features]``; the user
    product runs once per user.
    """

    def __init__(
        self,
        user_features: int,
        candidate_features: int,
        out_features: int,
        bias: bool = True,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _positive(
            user_features=user_features,
            candidate_features=candidate_features,
            out_features=out_features,
        )
        like = nn.Linear(
            user_features + candidate_features, out_features, bias, device=device, dtype=dtype
        )
        self._adopt(like, user_features)

    def _adopt(self, linear: nn.Linear, user_features: int) -> None:
        self.user_features = user_features
        self.candidate_features = linear.in_features - user_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)  # None where it has none, as nn.Linear

    @classmethod
    def from_linear(cls, linear: nn.Linear, user_features: int) -> Linear:
        """The layer computing ``linear`` over ``cat([x_u[cand_to_user], x_c], -1)``
        whose first ``user_features`` inputs are the user's; shares its parameters."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        if type(user_features) is not int or not 0 < user_features < linear.in_features:
            raise ValueError(
                f"user_features must be an int in [1, {linear.in_features}), the "
                f"linear's in_features, got {user_features!r}"
            )
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._adopt(linear, user_features)
        return layer

    def forward(
        self,
        x_u: torch.Tensor,
        x_c: torch.Tensor,
        cand_to_user: torch.Tensor,
        levels: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        fu = self.user_features
        return _ikbo.linear(
            self.weight[:, fu:], self.weight[:, :fu], x_c, x_u, cand_to_user, self.bias, levels
        )

    def extra_repr(self) -> str:
        return (
            f"user_features={self.user_features}, "
            f"candidate_features={self.candidate_features}, "
            f"out_features={self.out_features}, bias={self.bias is not None}"
        )


class MultiheadAttention(nn.Module):
    """Batch-first ``nn.MultiheadAttention`` of each candidate's queries onto
    its user's keys and values, which stay at U rows.

    Parameters as ``nn.MultiheadAttention(embed_dim, num_heads, bias=bias,
    kdim=kdim, vdim=vdim)`` names and initializes them (``in_proj_weight``, or
    ``q/k/v_proj_weight`` where kdim or vdim differs from embed_dim;
    ``in_proj_bias``; ``out_proj``), so state dicts load either way;
    :meth:`from_torch` shares a torch layer's parameters. The head dim
    ``embed_dim // num_heads`` must be 64, 128 or 256.

    Forward: ``query [B, L, embed_dim]``, ``key [U, S, kdim]`` and
    ``value [U, S, vdim]``, ``cand_to_user [B]``; or jagged histories, ``key
    [total, kdim]`` and ``value [total, vdim]`` with ``kv_offsets [U + 1]``
    (user u's rows ``kv_offsets[u]:kv_offsets[u + 1]``; one with none gets a
    zero attention output, before the output projection). Returns the
    attention output ``[B, L, embed_dim]`` alone: no attention weights, no
    masks beyond a user's length, no dropout.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        bias: bool = True,
        kdim: int | None = None,
        vdim: int | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _positive(embed_dim=embed_dim, num_heads=num_heads)
        if embed_dim % num_heads or embed_dim // num_heads not in _HEAD_DIMS:
            raise ValueError(
                f"embed_dim / num_heads must be 64, 128 or 256 (the head dims ikbo "
                f"attention takes), got {embed_dim} / {num_heads}"
            )
        # torch's own layer makes the parameters: their names, shapes and
        # initialization are then its own.
        like = nn.MultiheadAttention(
            embed_dim, num_heads, bias=bias, kdim=kdim, vdim=vdim, device=device, dtype=dtype
        )
        self._adopt(like)

    def _adopt(self, layer: nn.MultiheadAttention) -> None:
        self.embed_dim, self.num_heads = layer.embed_dim, layer.num_heads
        self.head_dim = layer.embed_dim // layer.num_heads
        self.kdim, self.vdim = layer.kdim, layer.vdim
        self._qkv_same_embed_dim = layer._qkv_same_embed_dim
        if self._qkv_same_embed_dim:
            names = ("in_proj_weight", "in_proj_bias")
        else:
            names = ("q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias")
        for name in names:
            self.register_parameter(name, getattr(layer, name))
        self.out_proj = layer.out_proj

    @classmethod
    def from_torch(cls, layer: nn.MultiheadAttention) -> MultiheadAttention:
        """The ikbo layer computing what ``layer`` computes (batch-first, its
        weights not requested) on K/V replicated by ``cand_to_user``; shares
        its parameters. ``layer`` must have no ``add_bias_kv`` or
        ``add_zero_attn``; its dropout is not applied (inference)."""
        if type(layer) is not nn.MultiheadAttention:
            raise TypeError(f"layer must be an nn.MultiheadAttention, got {type(layer).__name__}")
        if layer.bias_k is not None or layer.add_zero_attn:
            raise ValueError(
                "layer has add_bias_kv or add_zero_attn: ikbo attention reads the user's "
                "keys and values alone"
            )
        if layer.head_dim not in _HEAD_DIMS:
            raise ValueError(
                f"layer's head dim is {layer.head_dim}; ikbo attention takes 64, 128 or 256"
            )
        result = cls.__new__(cls)
        nn.Module.__init__(result)
        result._adopt(layer)
        return result

    def _projection_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._qkv_same_embed_dim:
            return self.in_proj_weight.chunk(3)
        return self.q_proj_weight, self.k_proj_weight, self.v_proj_weight

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cand_to_user: torch.Tensor,
        kv_offsets: torch.Tensor | None = None,
        levels: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        heads = (self.num_heads, self.head_dim)
        w_q, w_k, w_v = self._projection_weights()
        b_q, b_k, b_v = (
            self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None, None, None)
        )
        q = F.linear(query, w_q, b_q).unflatten(-1, heads)  # [B, L, H, D]
        k = F.linear(key, w_k, b_k).unflatten(-1, heads)  # per user: [U, S, H, D] or [total, H, D]
        v = F.linear(value, w_v, b_v).unflatten(-1, heads)
        out = _ikbo.attention(q, k, v, cand_to_user, kv_offsets, None, levels)
        return self.out_proj(out.flatten(-2))

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, kdim={self.kdim}, "
            f"vdim={self.vdim}, bias={self.in_proj_bias is not None}"
        )
