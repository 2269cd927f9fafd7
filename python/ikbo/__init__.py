"""ikbo: in-kernel broadcast (IKBO) ops for recommendation inference.

A ranking request scores B candidates for U users (U much smaller than B);
``cand_to_user[b]`` names candidate b's user. IKBO ops take user-side tensors
at their natural batch size U plus that mapping and broadcast inside the
kernel, so no replicated ``[B, ...]`` copy of user data is ever made.

Ops (any DLPack tensors: numpy on the CPU; torch, cupy, ... on CPU or CUDA):

- :func:`lce` -- ``out[b] = w_c @ e_c[b] + w_u @ e_u[cand_to_user[b]]``
- :func:`attention` -- candidate queries attending to their user's K/V
  history, dense or jagged.

Per-request and per-weights state is built once and reused:
:class:`CandidateMap` (the validated mapping), :class:`JaggedOffsets`
(variable-length histories), :class:`LcePlan` (prepared weights).

Invalid arguments raise ``ValueError`` naming the argument, what was expected
and what was given; outputs are left untouched when that happens.
"""

from ._C import (
    CandidateMap,
    JaggedOffsets,
    LcePlan,
    __version__,
    built_with_cuda,
    cuda_device_count,
)
from .ops import attention, lce

__all__ = [
    "CandidateMap",
    "JaggedOffsets",
    "LcePlan",
    "__version__",
    "attention",
    "built_with_cuda",
    "cuda_device_count",
    "lce",
]
