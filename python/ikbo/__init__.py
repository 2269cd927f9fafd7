"""ikbo: in-kernel broadcast (IKBO) ops for recommendation inference.

A ranking request scores B candidates for U users (U much smaller than B);
``cand_to_user[b]`` names candidate b's user. IKBO ops take user-side tensors
at their natural batch size U plus that mapping and broadcast inside the
kernel, so no replicated ``[B, ...]`` copy of user data is ever made.

Ops (any DLPack tensors: numpy on the CPU; torch, cupy, ... on CPU or CUDA):

- :func:`lce` -- ``out[b] = w_c @ e_c[b] + w_u @ e_u[cand_to_user[b]]``
- :func:`linear` -- ``out[b] = x_c[b] @ w_c^T + x_u[cand_to_user[b]] @ w_u^T + bias``,
  torch's linear over ``[user features | candidate features]``.
- :func:`attention` -- candidate queries attending to their user's K/V
  history, dense or jagged.

Per-request and per-weights state is built once and reused:
:class:`CandidateMap` (the validated mapping), :class:`JaggedOffsets`
(variable-length histories), :class:`LcePlan` and :class:`LinearPlan`
(prepared weights).

Invalid arguments raise ``ValueError`` naming the argument, what was expected
and what was given; outputs are left untouched when that happens.

With PyTorch installed (imported on demand, never by ``import ikbo``):
``ikbo.torch_ops`` registers ``torch.ops.ikbo.{lce, attention, linear}`` for
``torch.compile``, ``torch.export`` and CUDA graphs; ``ikbo.nn`` has layers
over them for new models (``LCE``, ``Linear``, ``MultiheadAttention``, with
torch's parameter names); and ``ikbo.rewrite`` rewrites models that replicate
user tensors into those ops (``ikbo.rewrite.optimize(model, sample_inputs)``,
or ``torch.compile(model, backend=ikbo.rewrite.backend)``).
"""

from ._C import (
    CandidateMap,
    JaggedOffsets,
    LcePlan,
    LinearPlan,
    __version__,
    built_with_cuda,
    cuda_device_count,
)
from .ops import attention, lce, linear

__all__ = [
    "CandidateMap",
    "JaggedOffsets",
    "LcePlan",
    "LinearPlan",
    "__version__",
    "attention",
    "built_with_cuda",
    "cuda_device_count",
    "lce",
    "linear",
]
