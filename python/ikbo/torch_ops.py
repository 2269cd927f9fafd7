"""The IKBO ops as PyTorch operators: ``torch.ops.ikbo.lce``, ``torch.ops.ikbo.attention``
and ``torch.ops.ikbo.linear``.

Registered with :func:`torch.library.custom_op`, each with a fake (meta)
implementation, so ``torch.compile(fullgraph=True)`` and ``torch.export`` trace
them as single opaque nodes, and eager calls run the library on CPU or CUDA
tensors of float16, bfloat16 or float32 (the library's own ``ValueError``
messages reach the caller unchanged). Inputs may have any strides: a
non-contiguous one is copied to the dense row-major layout the kernels read.
The ops are inference-only; backward through them raises.

Per-request and per-weights state
---------------------------------
Operators take tensors and scalars only, so the mapping travels as the plain
index tensor ``cand_to_user [B]`` (int32, or int64 as torch indexing makes
it), and what the library derives from it lives in a cache keyed by that
tensor:

- the :class:`~ikbo.CandidateMap` (counts, offsets, sortedness; for CUDA a
  device copy) is built by the first op of a request that sees the index
  tensor, at the cost of one device-to-host read of the mapping and a stream
  synchronization; every later op of the request that gets the same tensor
  (or a view of it) reuses it for free;
- :class:`~ikbo.LcePlan` / ``LinearPlan`` (the weights, copied and padded once)
  are cached the same way on the weight tensors, so a module's parameters are
  prepared on its first call only; slices of one weight (``w[:, :ku]``) are
  recognized as such on every call;
- jagged K/V offsets become a :class:`~ikbo.JaggedOffsets` the same way.

An entry stays valid while the tensors it came from are alive and unmodified:
the key is the identity of each tensor's storage owner (``t._base`` for a
view) plus the view's offset, shape and strides, and in-place writes are seen
through torch's version counter. Inference tensors (made under
``torch.inference_mode``) have no version counter; for those the entry keeps
a snapshot and compares contents on each reuse, which costs a device
synchronization on CUDA: make the index tensor outside inference mode
(``torch.no_grad`` is enough) to avoid it. Entries go away with their tensors.
:func:`build_counts` tells how many of each object were built, to check that.

CUDA graphs
-----------
The ops allocate only through torch's allocator on the current stream and
never synchronize once their state is cached (the first call on a device
that reaches cuBLAS also creates that device's cuBLAS handle, which
allocates), so they can be captured in a CUDA graph after one warm-up call
(or :func:`candidate_map` on the index tensor) has built the map: building
state inside a capture raises. A captured graph bakes in that request's
map, so replay it only for the same mapping. For that reason the ops carry
``torch.Tag.cudagraph_unsafe`` where the installed torch has it (2.9 and
later; with an older torch they are registered without it): the automatic
CUDA graphs of ``torch.compile(mode="reduce-overhead")``, which replay with
new inputs copied in, then run them outside the graph instead of reusing a
stale map.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from . import _C
from .ops import attention as _attention
from .ops import lce as _lce
from .ops import linear as _linear

__all__ = ["attention", "build_counts", "candidate_map", "lce", "linear"]

# Out-of-range entries must stay out of range when int64 indices are narrowed
# for the library, which then reports them (a plain cast would wrap 2**32 to 0).
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _storage_owner(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor._base is None else tensor._base


def _view_key(tensor: torch.Tensor) -> tuple[Hashable, ...]:
    return (
        id(_storage_owner(tensor)),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
        tensor.device,
    )


@dataclass
class _Source:
    """What a cache entry remembers of one tensor it was derived from."""

    owner: weakref.ref
    version: int | None  # None for inference tensors, which have no version counter
    snapshot: torch.Tensor | None  # the contents, for inference tensors only

    @staticmethod
    def of(tensor: torch.Tensor, on_owner_death: Callable[[Any], None]) -> _Source:
        owner = weakref.ref(_storage_owner(tensor), on_owner_death)
        if tensor.is_inference():
            return _Source(owner, None, tensor.clone())
        return _Source(owner, tensor._version, None)

    def matches(self, tensor: torch.Tensor) -> bool:
        if self.owner() is not _storage_owner(tensor):
            return False
        if self.snapshot is None:
            return self.version == tensor._version
        if tensor.is_cuda and torch.cuda.is_current_stream_capturing():
            # Comparing would synchronize inside the capture; the graph bakes
            # in this entry either way (see "CUDA graphs" above).
            return True
        return torch.equal(self.snapshot, tensor)


class _DerivedStateCache:
    """Library objects derived from torch tensors, reused while those tensors
    are alive and unmodified (see the module notes for the rules)."""

    def __init__(self) -> None:
        self._entries: dict[tuple[Hashable, ...], tuple[list[_Source], Any]] = {}
        self.builds: Counter[str] = Counter()

    def get(
        self,
        kind: str,
        sources: tuple[torch.Tensor, ...],
        parameters: tuple[Hashable, ...],
        build: Callable[[], Any],
    ) -> Any:
        """The ``kind`` object derived from ``sources`` with ``parameters``:
        cached, or made by ``build``."""
        key = (kind, *parameters, *(_view_key(tensor) for tensor in sources))
        entry = self._entries.get(key)
        if entry is not None and all(
            source.matches(tensor) for source, tensor in zip(entry[0], sources)
        ):
            return entry[1]
        if any(tensor.is_cuda for tensor in sources) and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "ikbo: the candidate map, offsets or weight plan for these tensors is not "
                "prepared, and preparing it copies to the host and synchronizes, which a CUDA "
                "graph capture forbids; run the op once (or ikbo.torch_ops.candidate_map) on the "
                "same tensors before capturing"
            )
        value = build()
        self.builds[kind] += 1

        # A dead owner's id may be reused by a new tensor: drop its entries at once.
        def forget(_reference: Any) -> None:
            self._entries.pop(key, None)

        self._entries[key] = ([_Source.of(tensor, forget) for tensor in sources], value)
        return value


_CACHE = _DerivedStateCache()


def _stream(tensor: torch.Tensor) -> int:
    return torch.cuda.current_stream(tensor.device).cuda_stream if tensor.is_cuda else 0


def _as_int32(indices: torch.Tensor) -> torch.Tensor:
    if indices.dtype == torch.int64:
        indices = indices.clamp(_INT32_MIN, _INT32_MAX).to(torch.int32)
    return indices.detach().contiguous()


def candidate_map(cand_to_user: torch.Tensor, num_users: int) -> _C.CandidateMap:
    """The :class:`~ikbo.CandidateMap` of ``cand_to_user`` (a 1-D int32 or int64
    tensor on the CPU or a CUDA device, values in ``[0, num_users)``), from the
    cache the torch ops share; built on first use.

    Call it once per request before capturing a CUDA graph, or to hand the same
    map to :func:`ikbo.lce` / :func:`ikbo.attention` directly.
    """
    num_users = int(num_users)
    return _CACHE.get(
        "CandidateMap",
        (cand_to_user,),
        (num_users,),
        lambda: _C.CandidateMap(_as_int32(cand_to_user), num_users, _stream(cand_to_user)),
    )


def build_counts() -> dict[str, int]:
    """How many of each derived object (``"CandidateMap"``, ``"JaggedOffsets"``,
    ``"LcePlan"``, ``"LinearPlan"``) the torch ops have built in this process:
    a served model should add one CandidateMap per request and no plans after
    its first call."""
    return dict(_CACHE.builds)


def _jagged_offsets(kv_offsets: torch.Tensor, total_rows: int) -> _C.JaggedOffsets:
    return _CACHE.get(
        "JaggedOffsets",
        (kv_offsets,),
        (total_rows,),
        lambda: _C.JaggedOffsets(_as_int32(kv_offsets), total_rows, _stream(kv_offsets)),
    )


def _lce_plan(w_c: torch.Tensor, w_u: torch.Tensor) -> _C.LcePlan:
    return _CACHE.get(
        "LcePlan",
        (w_c, w_u),
        (),
        lambda: _C.LcePlan(w_c.detach().contiguous(), w_u.detach().contiguous(), _stream(w_c)),
    )


def _linear_plan(w_c: torch.Tensor, w_u: torch.Tensor, bias: torch.Tensor | None) -> _C.LinearPlan:
    weights = (w_c, w_u) if bias is None else (w_c, w_u, bias)
    return _CACHE.get(
        "LinearPlan",
        weights,
        (),
        lambda: _C.LinearPlan(
            w_u.detach().contiguous(),
            w_c.detach().contiguous(),
            None if bias is None else bias.detach().contiguous(),
            _stream(w_c),
        ),
    )


# Replaying a captured graph with a new mapping would reuse the captured map.
_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


@torch.library.custom_op("ikbo::lce", mutates_args=(), tags=_TAGS)
def lce(
    w_c: torch.Tensor,
    w_u: torch.Tensor,
    e_c: torch.Tensor,
    e_u: torch.Tensor,
    cand_to_user: torch.Tensor,
) -> torch.Tensor:
    """``out[b] = w_c @ e_c[b] + w_u @ e_u[cand_to_user[b]]``.

    w_c ``[M, Kc]``, w_u ``[M, Ku]``, e_c ``[B, Kc, N]``, e_u ``[U, Ku, N]``
    (U = ``e_u.shape[0]``), cand_to_user ``[B]``; returns ``[B, M, N]``. One
    dtype (float16, bfloat16, float32) and device for all; fp32 accumulation,
    the two partial products summed in fp32 and rounded once. The weights are
    prepared on the first call and reused while unchanged.
    """
    plan = _lce_plan(w_c, w_u)
    mapping = candidate_map(cand_to_user, e_u.shape[0])
    return _lce(plan, None, e_c.contiguous(), e_u.contiguous(), mapping)


@lce.register_fake
def _lce_fake(w_c, w_u, e_c, e_u, cand_to_user):
    return e_c.new_empty((e_c.shape[0], w_c.shape[0], e_c.shape[-1]))


@torch.library.custom_op("ikbo::attention", mutates_args=(), tags=_TAGS)
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cand_to_user: torch.Tensor,
    kv_offsets: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """``out[b, :, h, :] = softmax(scale * q[b, :, h, :] @ k_u[:, h, :]^T) @ v_u[:, h, :]``
    with ``u = cand_to_user[b]``, non-causal.

    q ``[B, n_seed, H, D]`` (D in {64, 128, 256}); k, v dense ``[U, S, H, D]``, or
    jagged ``[total, H, D]`` with kv_offsets ``[U + 1]`` (a user without rows
    gets zeros, as does a query row whose every key scores -inf, where torch's
    softmax gives NaN); scale defaults to ``1 / sqrt(D)``. Returns q's shape. Note the
    layout: torch's ``scaled_dot_product_attention`` takes ``[B, H, L, D]``,
    which is ``q.transpose(1, 2)`` of this one.
    """
    if kv_offsets is None:
        offsets, num_users = None, k.shape[0]
    else:
        offsets = _jagged_offsets(kv_offsets, k.shape[0])
        num_users = offsets.num_users
    mapping = candidate_map(cand_to_user, num_users)
    return _attention(
        q.contiguous(), k.contiguous(), v.contiguous(), mapping, kv_offsets=offsets, scale=scale
    )


@attention.register_fake
def _attention_fake(q, k, v, cand_to_user, kv_offsets=None, scale=None):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("ikbo::linear", mutates_args=(), tags=_TAGS)
def linear(
    w_c: torch.Tensor,
    w_u: torch.Tensor,
    x_c: torch.Tensor,
    x_u: torch.Tensor,
    cand_to_user: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y[b] = x_c[b] @ w_c^T + x_u[cand_to_user[b]] @ w_u^T + bias``: a linear
    layer over ``[user features | candidate features]`` without the replicated
    user rows.

    w_c ``[N_out, Kc]``, w_u ``[N_out, Ku]`` (column blocks of torch's weight,
    e.g. ``weight[:, :ku]`` and ``weight[:, ku:]``: views are recognized and
    prepared once), x_c ``[B, Kc]``, x_u ``[U, Ku]`` (U = ``x_u.shape[0]``),
    bias ``[N_out]`` or None; returns ``[B, N_out]``. The user part, bias
    included, is computed once per user in fp32 and added in fp32, rounded once.
    """
    plan = _linear_plan(w_c, w_u, bias)
    mapping = candidate_map(cand_to_user, x_u.shape[0])
    return _linear(plan, x_c.contiguous(), x_u.contiguous(), mapping)


@linear.register_fake
def _linear_fake(w_c, w_u, x_c, x_u, cand_to_user, bias=None):
    return x_c.new_empty((x_c.shape[0], w_c.shape[0]))
