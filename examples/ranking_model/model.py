"""A small ranking model written the usual broadcast way, in plain PyTorch.

One request scores B candidates for U users (U << B); ``cand_to_user[b]``
names candidate b's user. User-side work (the user tower, the key and value
projections of the history) runs once per user, and, as in most recsys
serving code, every user tensor is then replicated to the candidates with
``x_u[cand_to_user]`` right before the layer that mixes it with candidate
data. Those replications are what ``ikbo.rewrite.optimize`` removes; this
file knows nothing about ikbo.

Inputs (``make_request`` in run.py draws random ones), sizes from
:class:`RankingConfig`:

- ``user_features [U, F_u]``, ``user_embeddings [U, Ku, N]`` (the user's
  sparse features, looked up and stacked), ``user_history [U, S, N]`` (item
  embeddings of the user's recent engagements);
- ``candidate_features [B, F_c]``, ``candidate_embeddings [B, Kc, N]``;
- ``cand_to_user [B]`` (int64, as torch indexing makes it).

Layers, in order:

1. LCE: the user and candidate embeddings stacked along K,
   ``[B, Ku + Kc, N]``, compressed by one weight ``[M, Ku + Kc]`` into M
   embeddings ``[B, M, N]``;
2. target attention: the first n_seed compressed embeddings of each
   candidate are its seed tokens; projected to H heads of D, they attend to
   the user's projected history (``F.scaled_dot_product_attention``,
   K/V gathered per candidate), and are mean-pooled and layer-normed. With
   ``attention="mha"`` the layer is ``nn.MultiheadAttention`` instead, fed
   the history replicated to the candidates (the module projects K/V from
   what it is given: per candidate);
3. the MLP over ``concat(user tower output, candidate features, projected
   compressed embeddings, attention output)``, ending in one score (a
   logit) per candidate.

:class:`VendorRankingModel` is the same model for requests of three levels,
user -> vendor -> candidate (an ads request: users, the advertisers bidding
for them, their ads): every user tensor reaches the candidates through the
vendors, ``x_u[vendor_to_user][cand_to_vendor]``, and the MLP also takes the
candidate's vendor features ``vendor_features [V, F_v]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class RankingConfig:
    """Layer sizes. The defaults are SPEC's reference shapes: LCE M=433,
    N=256, Ku=1178, Kc=866; attention H=2, D=128, n_seed=64 onto S=2048
    history items."""

    compressed_embeddings: int = 433  # M
    embedding_dim: int = 256  # N, also the history items' width
    user_embeddings: int = 1178  # Ku
    candidate_embeddings: int = 866  # Kc
    history_length: int = 2048  # S
    heads: int = 2  # H
    head_dim: int = 128  # D
    seed_tokens: int = 64  # n_seed
    user_features: int = 512  # F_u
    candidate_features: int = 256  # F_c
    user_tower_dim: int = 256
    compressed_projection_dim: int = 8  # per compressed embedding, into the MLP
    mlp_dims: tuple[int, ...] = (512, 256)
    # "sdpa": K/V projected per user by the model, gathered, then SDPA;
    # "mha": nn.MultiheadAttention (kdim = vdim = N) on the replicated history.
    attention: str = "sdpa"
    vendor_features: int = 64  # F_v, VendorRankingModel only


ATTENTION_LAYERS = ("sdpa", "mha")
SPEC_CONFIG = RankingConfig()
# About a quarter of SPEC's widths, for two CPU cores (K still no multiple of 8).
SMALL_CONFIG = RankingConfig(
    compressed_embeddings=109,
    embedding_dim=64,
    user_embeddings=294,
    candidate_embeddings=218,
    history_length=512,
    heads=2,
    head_dim=64,
    seed_tokens=16,
    user_features=128,
    candidate_features=64,
    user_tower_dim=64,
    vendor_features=16,
    compressed_projection_dim=4,
    mlp_dims=(256, 128),
)


class RankingModel(nn.Module):
    """Scores each candidate of a request: ``forward`` takes the inputs listed
    at the top of this file, in that order, and returns ``[B]`` logits."""

    def __init__(self, config: RankingConfig) -> None:
        super().__init__()
        if config.seed_tokens > config.compressed_embeddings:
            raise ValueError(
                f"seed_tokens = {config.seed_tokens} must not exceed "
                f"compressed_embeddings = {config.compressed_embeddings}"
            )
        if config.attention not in ATTENTION_LAYERS:
            raise ValueError(
                f"attention = {config.attention!r} must be one of {', '.join(ATTENTION_LAYERS)}"
            )
        self.config = config
        attention_dim = config.heads * config.head_dim
        self.user_tower = nn.Sequential(
            nn.Linear(config.user_features, config.user_tower_dim), nn.ReLU()
        )
        stacked = config.user_embeddings + config.candidate_embeddings
        self.compression = nn.Parameter(torch.empty(config.compressed_embeddings, stacked))
        # nn.Linear's initialization, fan-in Ku + Kc.
        nn.init.kaiming_uniform_(self.compression, a=math.sqrt(5))
        self.query = nn.Linear(config.embedding_dim, attention_dim)
        if config.attention == "mha":
            self.attention = nn.MultiheadAttention(
                attention_dim,
                config.heads,
                kdim=config.embedding_dim,
                vdim=config.embedding_dim,
                batch_first=True,
            )
        else:
            self.key = nn.Linear(config.embedding_dim, attention_dim)
            self.value = nn.Linear(config.embedding_dim, attention_dim)
        self.attention_norm = nn.LayerNorm(attention_dim)
        self.compressed_projection = nn.Linear(
            config.embedding_dim, config.compressed_projection_dim
        )
        width = (
            config.user_tower_dim
            + self.vendor_width
            + config.candidate_features
            + config.compressed_embeddings * config.compressed_projection_dim
            + attention_dim
        )
        layers: list[nn.Module] = []
        for hidden in config.mlp_dims:
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*layers)

    # Width of the per-candidate features between the user's and the candidate's.
    vendor_width = 0

    def forward(
        self,
        user_features: torch.Tensor,
        user_embeddings: torch.Tensor,
        user_history: torch.Tensor,
        candidate_features: torch.Tensor,
        candidate_embeddings: torch.Tensor,
        cand_to_user: torch.Tensor,
    ) -> torch.Tensor:
        def to_candidates(user_tensor: torch.Tensor) -> torch.Tensor:
            return user_tensor[cand_to_user]

        return self._score(
            user_features,
            user_embeddings,
            user_history,
            [candidate_features],
            candidate_embeddings,
            to_candidates,
        )

    def _score(
        self,
        user_features: torch.Tensor,
        user_embeddings: torch.Tensor,
        user_history: torch.Tensor,
        candidate_features: list[torch.Tensor],
        candidate_embeddings: torch.Tensor,
        to_candidates: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """The scores, with ``to_candidates`` replicating a user tensor to the
        candidates and ``candidate_features`` the MLP's per-candidate inputs
        after the user tower's."""
        # Once per user.
        user_repr = self.user_tower(user_features)  # [U, user_tower_dim]

        # LCE over the stacked user and candidate embeddings.
        stacked = torch.cat([to_candidates(user_embeddings), candidate_embeddings], dim=1)
        compressed = torch.matmul(self.compression, stacked)  # [B, M, N]

        # Target attention from each candidate's seed tokens onto its user's history.
        queries = self.query(compressed[:, : self.config.seed_tokens])  # [B, n_seed, H * D]
        attention_summary = self.attention_norm(
            self._attend(queries, user_history, to_candidates).mean(dim=1)
        )

        features = torch.cat(
            [
                to_candidates(user_repr),
                *candidate_features,
                self.compressed_projection(compressed).flatten(1),
                attention_summary,
            ],
            dim=-1,
        )
        return self.mlp(features).squeeze(-1)

    def _attend(
        self,
        queries: torch.Tensor,
        user_history: torch.Tensor,
        to_candidates: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """``[B, n_seed, H * D]`` attention outputs of the seed queries."""
        if self.config.attention == "mha":
            history = to_candidates(user_history)  # [B, S, N]
            attended, _ = self.attention(queries, history, history, need_weights=False)
            return attended
        heads, head_dim = self.config.heads, self.config.head_dim
        keys = self.key(user_history).unflatten(-1, (heads, head_dim))  # [U, S, H, D], per user
        values = self.value(user_history).unflatten(-1, (heads, head_dim))
        attended = F.scaled_dot_product_attention(
            queries.unflatten(-1, (heads, head_dim)).transpose(1, 2),
            to_candidates(keys).transpose(1, 2),
            to_candidates(values).transpose(1, 2),
        )  # [B, H, n_seed, D]
        return attended.transpose(1, 2).flatten(2)


class VendorRankingModel(RankingModel):
    """The model for requests of three levels, user -> vendor -> candidate:
    ``forward(user_features, user_embeddings, user_history, vendor_features,
    candidate_features, candidate_embeddings, vendor_to_user,
    cand_to_vendor)``, with ``vendor_features [V, F_v]``, ``vendor_to_user
    [V]`` and ``cand_to_vendor [B]``. User tensors reach the candidates
    through the vendors, and the MLP takes the vendor's features after the
    user tower's."""

    @property
    def vendor_width(self) -> int:
        return self.config.vendor_features

    def forward(  # type: ignore[override]
        self,
        user_features: torch.Tensor,
        user_embeddings: torch.Tensor,
        user_history: torch.Tensor,
        vendor_features: torch.Tensor,
        candidate_features: torch.Tensor,
        candidate_embeddings: torch.Tensor,
        vendor_to_user: torch.Tensor,
        cand_to_vendor: torch.Tensor,
    ) -> torch.Tensor:
        def to_candidates(user_tensor: torch.Tensor) -> torch.Tensor:
            return user_tensor[vendor_to_user][cand_to_vendor]

        return self._score(
            user_features,
            user_embeddings,
            user_history,
            [vendor_features[cand_to_vendor], candidate_features],
            candidate_embeddings,
            to_candidates,
        )
