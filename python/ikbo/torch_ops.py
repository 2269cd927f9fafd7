"""The IKBO ops as PyTorch operators: ``torch.ops.ikbo.lce``, ``torch.ops.ikbo.attention``
and ``torch.ops.ikbo.linear``.

Registered with :class:`torch.library.Library`, each with a fake (meta)
implementation, so ``torch.compile(fullgraph=True)`` and ``torch.export`` trace
them as single opaque nodes, and eager calls run the library on CPU or CUDA
tensors of float16, bfloat16 or float32. The library's own ``ValueError``
messages reach the caller unchanged; torch's dispatcher refuses a non-tensor
argument by name (``RuntimeError``), None for a required tensor raises
``TypeError``, and a sparse tensor ``ValueError``. The fake implementations
check what they can see (ranks, extents, dtypes, devices) as the library
does, so tracing an invalid call raises the same kind of ``ValueError``
instead of giving it an output shape.
Inputs may have any strides: a non-contiguous one is copied to the dense
row-major layout the kernels read.
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
  (or a view of it) reuses it (for a CPU index tensor, after an O(B)
  comparison: see below); a request of more levels passes each level's index
  tensor as ``levels``, and the map composed from them is keyed on all of them;
- :class:`~ikbo.LcePlan` / ``LinearPlan`` (the weights, copied and padded once)
  are cached the same way on the weight tensors, so a module's parameters are
  prepared on its first call only; slices of one weight (``w[:, :ku]``) are
  recognized as such on every call;
- jagged K/V offsets become a :class:`~ikbo.JaggedOffsets` the same way.

An entry is reused only while every tensor it came from is alive, still
backed by the same memory, and unchanged. The key is the identity of each
tensor's storage owner (``t._base`` for a view) plus the view's offset, shape,
strides, dtype and device; the entry also records the storage itself (the
object and its address), so ``p.data = other``, ``p.set_(other)`` and a module
moved away and back (``model.cpu().cuda()``) rebuild it. Whether the contents
are unchanged is told so:

- an index tensor on the CPU (the mapping, jagged offsets: B or U + 1
  entries) is compared with a copy of its contents that the entry keeps, bit
  for bit, on every reuse, so every write is seen, including those torch's
  version counter misses: through a numpy array sharing the memory
  (``torch.from_numpy(buf)`` with ``buf`` refilled per request, the
  zero-copy serving pattern) or another library over DLPack;
- any other tensor (weights on any device, a CUDA index tensor) is not read,
  since that would cost a pass over each weight on every op, or a host-device
  synchronization: it counts as unchanged while torch's version counter says
  so. That sees in-place ops through the tensor, its views and its
  ``detach()`` aliases (``copy_``, ``mul_``, ``load_state_dict``, optimizer
  steps, index assignment), but not writes through ``p.data``
  (``p.data.mul_(2)``), through another framework sharing the memory (numpy,
  DLPack, cupy, CUDA IPC) or by custom kernels, nor a storage resized away
  and back (``untyped_storage().resize_``) to its old address. After such a
  write, call :func:`invalidate` on the tensor (or :func:`clear_cache`)
  before the next op;
- an inference tensor (made under ``torch.inference_mode``) has no version
  counter and is compared by contents, which on CUDA costs a device
  synchronization per reuse: make a CUDA index tensor outside inference mode
  (``torch.no_grad`` is enough) to avoid it.

Entries go away with their tensors. :func:`build_counts` tells how many of
each object were built, to check that.

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

import atexit
import math
import numbers
import weakref
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from . import _C
from .ops import _current_stream, _dlpack, _map_storage, _offsets_storage
from .ops import attention as _attention
from .ops import lce as _lce
from .ops import linear as _linear

__all__ = [
    "attention",
    "build_counts",
    "candidate_map",
    "clear_cache",
    "invalidate",
    "lce",
    "linear",
]

# Out-of-range entries must stay out of range when int64 indices are narrowed
# for the library, which then reports them (a plain cast would wrap 2**32 to 0).
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
# Integer dtypes by element size: snapshots are compared bit for bit, so a NaN
# weight equals itself and -0.0 differs from 0.0.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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


# The objects derived from index tensors (B or U + 1 entries): comparing
# those by contents on the CPU costs next to nothing.
_INDEX_KINDS = frozenset({"CandidateMap", "JaggedOffsets"})


def _compared_by_contents(tensor: torch.Tensor, kind: str) -> bool:
    # Reading a CPU tensor needs no synchronization, and an index tensor is
    # small; inference tensors have no version counter.
    return (tensor.device.type == "cpu" and kind in _INDEX_KINDS) or tensor.is_inference()


def _same_bits(snapshot: torch.Tensor, tensor: torch.Tensor) -> bool:
    if not tensor.is_floating_point():  # equal integers are equal bits (an index tensor)
        return torch.equal(snapshot, tensor)
    bits = _BITS[tensor.element_size()]
    return torch.equal(snapshot.view(bits), tensor.detach().view(bits))


@dataclass
class _Source:
    """What a cache entry remembers of one tensor it was derived from."""

    owner: weakref.ref
    # The storage object, by a weak reference (which keeps its identity from
    # passing to a new storage), and its memory's address, which resize_ moves.
    storage: StorageWeakRef
    address: int
    device: torch.device
    version: int | None  # None when the contents are compared
    snapshot: torch.Tensor | None  # the contents, for CPU index and inference tensors only

    @staticmethod
    def of(tensor: torch.Tensor, kind: str, on_owner_death: Callable[[Any], None]) -> _Source:
        owner = weakref.ref(_storage_owner(tensor), on_owner_death)
        storage = tensor.untyped_storage()
        if _compared_by_contents(tensor, kind):
            version = None
            snapshot = tensor.detach().clone(memory_format=torch.contiguous_format)
        else:
            version, snapshot = tensor._version, None
        return _Source(
            owner, StorageWeakRef(storage), storage.data_ptr(), tensor.device, version, snapshot
        )

    def shares_memory_with(self, tensor: torch.Tensor) -> bool:
        storage = tensor.untyped_storage()
        return self.storage.cdata == storage._cdata or (
            self.device == tensor.device and self.address == storage.data_ptr() != 0
        )

    def matches(self, tensor: torch.Tensor) -> bool:
        storage = tensor.untyped_storage()
        if (
            self.owner() is not _storage_owner(tensor)
            or self.storage.cdata != storage._cdata
            or self.address != storage.data_ptr()
        ):
            return False
        if self.snapshot is None:
            return self.version == tensor._version
        if tensor.is_cuda and torch.cuda.is_current_stream_capturing():
            # Comparing would synchronize inside the capture; the graph bakes
            # in this entry either way (see "CUDA graphs" above).
            return True
        return _same_bits(self.snapshot, tensor)


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
        key = (kind, *parameters, *map(_view_key, sources))
        entry = self._entries.get(key)
        if entry is not None and all(map(_Source.matches, entry[0], sources)):
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

        # A dead owner's id may be reused by a new tensor: drop its entries at
        # once. A stale entry is replaced under the same key, never kept.
        def forget(_reference: Any) -> None:
            self._entries.pop(key, None)

        self._entries[key] = ([_Source.of(tensor, kind, forget) for tensor in sources], value)
        return value

    def invalidate(self, tensor: torch.Tensor) -> None:
        owner = _storage_owner(tensor)
        for key, (sources, _) in list(self._entries.items()):
            if any(
                source.owner() is owner or source.shares_memory_with(tensor) for source in sources
            ):
                self._entries.pop(key, None)

    def clear(self) -> None:
        self._entries.clear()


_CACHE = _DerivedStateCache()
# The library objects go at exit, before the interpreter tears modules down in
# no set order: one still referenced then (as after some torch.compile runs)
# would outlive the extension, which reports it as leaked; and a device
# allocation is best freed while its CUDA context is alive.
atexit.register(_CACHE.clear)


def invalidate(tensor: torch.Tensor) -> None:
    """Forgets the candidate maps, offsets and weight plans derived from
    ``tensor``'s memory (from it, its views, or any tensor sharing its
    storage, such as ``p.data``); the next op rebuilds them.

    Needed only for a tensor written behind torch's version counter (through
    ``p.data``, numpy or another framework, a custom kernel), other than an
    index tensor on the CPU, which is compared by contents: see the module
    notes.
    """
    _CACHE.invalidate(tensor)


def clear_cache() -> None:
    """Forgets every candidate map, offsets object and weight plan the torch ops
    hold (:func:`invalidate` for all tensors at once)."""
    _CACHE.clear()


def _as_int32(indices: torch.Tensor, name: str) -> torch.Tensor:
    if indices.dtype == torch.int64:
        if indices.device.type == "cpu":
            # Read here, where it costs nothing, the value the clamp below
            # would hide from the library's message.
            outside = ((indices < _INT32_MIN) | (indices > _INT32_MAX)).nonzero()
            if len(outside):
                position = tuple(outside[0].tolist())
                index = position[0] if len(position) == 1 else list(position)
                raise ValueError(
                    f"{name}[{index}] = {indices[position].item()} is outside the int32 range "
                    "the library takes"
                )
        indices = indices.clamp(_INT32_MIN, _INT32_MAX).to(torch.int32)
    return indices.detach().contiguous()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _shape(tensor: torch.Tensor) -> str:
    return "[" + ", ".join(str(extent) for extent in tensor.shape) + "]"


def _check(condition: Any, message: Callable[[], str]) -> None:
    """Raises ValueError(message()) unless ``condition``; under torch.compile or
    torch.export a symbolic condition becomes a guard or a runtime assertion."""
    if condition is not True:  # False, or symbolic
        torch._check_value(condition, message)


def _check_tensors(**tensors: Any) -> None:
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
        if value.layout != torch.strided:
            raise ValueError(f"{name} must be a dense (strided) tensor, got layout {value.layout}")


def _checked_before_copies(
    check: Callable[[], None], rows: torch.Tensor, rank: int, *tensors: torch.Tensor | None
) -> None:
    """Runs ``check`` (the op's shape checks) first where the op would read U
    from ``rows`` of the wrong rank, or copy one of ``tensors`` to the dense
    layout: an invalid expanded view must not be materialized."""
    if rows.dim() != rank or not all(
        tensor is None or tensor.is_contiguous() for tensor in tensors
    ):
        check()


def _check_index_dtype(tensor: torch.Tensor, name: str) -> None:
    _check(
        tensor.dtype in _INDEX_DTYPES,
        lambda: f"{name} must have dtype int32 or int64, got {_dtype_name(tensor.dtype)}",
    )


def _check_float_dtype(tensor: torch.Tensor, name: str) -> None:
    _check(
        tensor.dtype in _FLOAT_DTYPES,
        lambda: (
            f"{name} must have dtype float16, bfloat16 or float32, got {_dtype_name(tensor.dtype)}"
        ),
    )


# The checks below mirror the library's (same conditions, same kind of
# message) for what the fake implementations can see: ranks, extents, dtypes
# and devices, never values.


def _check_tensor(
    tensor: torch.Tensor, name: str, dtype: torch.dtype, device: torch.device, rank: int
) -> None:
    _check(
        tensor.dim() == rank,
        lambda: f"{name} must have {rank} dimensions, got {tensor.dim()} (shape {_shape(tensor)})",
    )
    _check(
        tensor.dtype == dtype,
        lambda: f"{name} must have dtype {_dtype_name(dtype)}, got {_dtype_name(tensor.dtype)}",
    )
    _check(tensor.device == device, lambda: f"{name} must be on {device}, got {tensor.device}")


def _check_dim(tensor: torch.Tensor, name: str, dim: int, expected: Any, meaning: str) -> None:
    _check(
        tensor.shape[dim] == expected,
        lambda: (
            f"{name} dimension {dim} must be {expected} ({meaning}), got "
            f"{tensor.shape[dim]} (shape {_shape(tensor)})"
        ),
    )


def _check_positive(tensor: torch.Tensor, name: str, dim: int, meaning: str) -> None:
    _check(
        tensor.shape[dim] >= 1,
        lambda: f"{name} dimension {dim} ({meaning}) must be >= 1, got {tensor.shape[dim]}",
    )


def _check_mapping(
    cand_to_user: torch.Tensor,
    candidates: torch.Tensor,
    candidates_name: str,
    users: torch.Tensor,
    users_name: str,
    users_meaning: str,
    least: int,
    device: torch.device,
) -> None:
    """cand_to_user against the candidates (dimension 0 is B) and the users,
    whose dimension 0 (U, or U + 1 for offsets) may be below ``least`` only in a
    request without candidates."""
    _check_index_dtype(cand_to_user, "cand_to_user")
    _check(
        cand_to_user.dim() == 1,
        lambda: (
            f"cand_to_user must have 1 dimension, got {cand_to_user.dim()} "
            f"(shape {_shape(cand_to_user)})"
        ),
    )
    _check(
        cand_to_user.device == device,
        lambda: (
            f"cand_to_user must be on {device} like {candidates_name}, got {cand_to_user.device}"
        ),
    )
    _check_dim(candidates, candidates_name, 0, cand_to_user.shape[0], "the length of cand_to_user")
    _check(
        (users.shape[0] >= least) | (cand_to_user.shape[0] == 0),
        lambda: (
            f"{users_name} dimension 0 ({users_meaning}) must be >= {least} when cand_to_user "
            f"has entries, got {users.shape[0]} (shape {_shape(users)})"
        ),
    )


def _check_lce(w_c, w_u, e_c, e_u, cand_to_user) -> None:
    _check_tensors(w_c=w_c, w_u=w_u, e_c=e_c, e_u=e_u, cand_to_user=cand_to_user)
    _check_float_dtype(w_c, "w_c")
    dtype, device = w_c.dtype, w_c.device
    _check_tensor(w_c, "w_c", dtype, device, 2)
    _check_tensor(w_u, "w_u", dtype, device, 2)
    _check_positive(w_c, "w_c", 0, "M")
    _check_dim(w_u, "w_u", 0, w_c.shape[0], "M of w_c")
    _check_positive(w_c, "w_c", 1, "Kc")
    _check_positive(w_u, "w_u", 1, "Ku")
    _check_tensor(e_c, "e_c", dtype, device, 3)
    _check_tensor(e_u, "e_u", dtype, device, 3)
    _check_dim(e_c, "e_c", 1, w_c.shape[1], "Kc of w_c")
    _check_dim(e_u, "e_u", 1, w_u.shape[1], "Ku of w_u")
    _check_positive(e_c, "e_c", 2, "N")
    _check_dim(e_u, "e_u", 2, e_c.shape[2], "N of e_c")
    _check_mapping(cand_to_user, e_c, "e_c", e_u, "e_u", "U", 1, device)


def _check_attention(q, k, v, cand_to_user, kv_offsets, scale) -> None:
    _check_tensors(q=q, k=k, v=v, cand_to_user=cand_to_user)
    _check_float_dtype(q, "q")
    dtype, device = q.dtype, q.device
    _check_tensor(q, "q", dtype, device, 4)
    kv_rank = 4 if kv_offsets is None else 3
    _check_tensor(k, "k", dtype, device, kv_rank)
    _check_tensor(v, "v", dtype, device, kv_rank)
    _check_positive(q, "q", 1, "n_seed")
    _check_positive(q, "q", 2, "H")
    head_dim = q.shape[3]
    _check(
        (head_dim == 64) | (head_dim == 128) | (head_dim == 256),
        lambda: f"q dimension 3 (head dim D) must be 64, 128 or 256, got {head_dim}",
    )
    _check_dim(k, "k", kv_rank - 2, q.shape[2], "H of q")
    _check_dim(k, "k", kv_rank - 1, head_dim, "D of q")
    same_shape = True
    for dim in range(kv_rank):
        same_shape = same_shape & (v.shape[dim] == k.shape[dim])
    _check(same_shape, lambda: f"v must have shape {_shape(k)} (the shape of k), got {_shape(v)}")
    if kv_offsets is None:
        _check_mapping(cand_to_user, q, "q", k, "k", "U", 1, device)
    else:
        _check_tensors(kv_offsets=kv_offsets)
        _check_index_dtype(kv_offsets, "kv_offsets")
        _check(
            kv_offsets.dim() == 1,
            lambda: (
                f"kv_offsets must have 1 dimension, got {kv_offsets.dim()} "
                f"(shape {_shape(kv_offsets)})"
            ),
        )
        _check(
            kv_offsets.device == device,
            lambda: f"kv_offsets must be on {device} like q, got {kv_offsets.device}",
        )
        _check(
            kv_offsets.shape[0] >= 1,
            lambda: "kv_offsets must have at least 1 entry (U + 1), got 0",
        )
        _check_mapping(cand_to_user, q, "q", kv_offsets, "kv_offsets", "U + 1", 2, device)
    if scale is not None:
        _check(math.isfinite(scale), lambda: f"scale must be finite, got {scale}")


def _check_linear(w_c, w_u, x_c, x_u, cand_to_user, bias) -> None:
    _check_tensors(w_c=w_c, w_u=w_u, x_c=x_c, x_u=x_u, cand_to_user=cand_to_user)
    _check_float_dtype(w_u, "w_u")
    dtype, device = w_u.dtype, w_u.device
    _check_tensor(w_u, "w_u", dtype, device, 2)
    _check_tensor(w_c, "w_c", dtype, device, 2)
    _check_dim(w_c, "w_c", 0, w_u.shape[0], "N_out of w_u")
    _check_positive(w_u, "w_u", 0, "N_out")
    _check_positive(w_u, "w_u", 1, "Ku")
    _check_positive(w_c, "w_c", 1, "Kc")
    if bias is not None:
        _check_tensors(bias=bias)
        _check_tensor(bias, "bias", dtype, device, 1)
        _check_dim(bias, "bias", 0, w_u.shape[0], "N_out of w_u")
    _check_tensor(x_c, "x_c", dtype, device, 2)
    _check_tensor(x_u, "x_u", dtype, device, 2)
    _check_dim(x_c, "x_c", 1, w_c.shape[1], "Kc of w_c")
    _check_dim(x_u, "x_u", 1, w_u.shape[1], "Ku of w_u")
    _check_mapping(cand_to_user, x_c, "x_c", x_u, "x_u", "U", 1, device)


def _rows(tensor: torch.Tensor) -> int:
    """Dimension 0 of ``tensor`` (1 for a scalar, which the library reports)."""
    return tensor.shape[0] if tensor.dim() >= 1 else 1


def candidate_map(
    cand_to_user: torch.Tensor, num_users: int, levels: Sequence[torch.Tensor] | None = None
) -> _C.CandidateMap:
    """The :class:`~ikbo.CandidateMap` of ``cand_to_user`` (a 1-D int32 or int64
    tensor on the CPU or a CUDA device, values in ``[0, num_users)``), from the
    cache the torch ops share; built on first use.

    ``levels``: a request of more levels (user -> vendor -> candidate, say):
    ``cand_to_user`` maps the candidates to the groups of ``levels[0]``, whose
    entries map those groups to the next level's, and so on; the last maps to
    the ``num_users`` users. The map is their composition (as
    :meth:`ikbo.CandidateMap.compose` gives, with each tensor read once and
    only the result copied to the device), cached on all of these tensors.

    Call it once per request before capturing a CUDA graph, or to hand the same
    map to :func:`ikbo.lce` / :func:`ikbo.attention` directly.
    """
    _check_tensors(cand_to_user=cand_to_user)
    _check_index_dtype(cand_to_user, "cand_to_user")
    levels = tuple(levels or ())
    for position, level in enumerate(levels):  # the cache's key reads them as tensors
        _check_tensors(**{f"levels[{position}]": level})
    if isinstance(num_users, bool) or not isinstance(num_users, numbers.Integral):
        raise TypeError(f"num_users must be an int, got {type(num_users).__name__}")
    num_users = int(num_users)

    def build() -> _C.CandidateMap:
        # Checked when a map is built, not on each reuse: the key holds what
        # is checked (dtype, rank, device).
        _check_levels(levels, cand_to_user.device)
        read = levels if cand_to_user.shape[0] else ()  # no candidates: no level is read
        return _C.CandidateMap(
            _dlpack(_as_int32(cand_to_user, "cand_to_user")),
            num_users,
            _current_stream(cand_to_user),
            [_dlpack(_as_int32(level, f"levels[{i}]")) for i, level in enumerate(read)],
            _map_storage(cand_to_user, num_users),
        )

    return _CACHE.get("CandidateMap", (cand_to_user, *levels), (num_users, len(levels)), build)


def _check_levels(levels: Sequence[torch.Tensor], device: torch.device) -> None:
    """Each level's index: a 1-D int32 or int64 tensor on ``device``."""
    for position, level in enumerate(levels):
        name = f"levels[{position}]"
        _check_tensors(**{name: level})
        _check_index_dtype(level, name)
        _check(
            level.dim() == 1,
            lambda name=name, level=level: (
                f"{name} must have 1 dimension, got {level.dim()} (shape {_shape(level)})"
            ),
        )
        _check(
            level.device == device,
            lambda name=name, level=level: (
                f"{name} must be on {device} like cand_to_user, got {level.device}"
            ),
        )


def build_counts() -> dict[str, int]:
    """How many of each derived object (``"CandidateMap"``, ``"JaggedOffsets"``,
    ``"LcePlan"``, ``"LinearPlan"``) the torch ops have built in this process:
    a served model should add one CandidateMap per request and no plans after
    its first call."""
    return dict(_CACHE.builds)


def _jagged_offsets(kv_offsets: torch.Tensor, total_rows: int) -> _C.JaggedOffsets:
    _check_index_dtype(kv_offsets, "kv_offsets")
    return _CACHE.get(
        "JaggedOffsets",
        (kv_offsets,),
        (total_rows,),
        lambda: _C.JaggedOffsets(
            _dlpack(_as_int32(kv_offsets, "kv_offsets")),
            total_rows,
            _current_stream(kv_offsets),
            _offsets_storage(kv_offsets),
        ),
    )


def _lce_plan(w_c: torch.Tensor, w_u: torch.Tensor, check: Callable[[], None]) -> _C.LcePlan:
    """The cached plan of (w_c, w_u); a new one is built after ``check`` (the
    op's shape checks), so that invalid weights are never copied."""

    def build() -> _C.LcePlan:
        check()
        return _C.LcePlan(
            _dlpack(w_c.detach().contiguous()),
            _dlpack(w_u.detach().contiguous()),
            _current_stream(w_c),
        )

    return _CACHE.get("LcePlan", (w_c, w_u), (), build)


def _linear_plan(
    w_c: torch.Tensor, w_u: torch.Tensor, bias: torch.Tensor | None, check: Callable[[], None]
) -> _C.LinearPlan:
    """As :func:`_lce_plan`, for (w_c, w_u, bias)."""

    def build() -> _C.LinearPlan:
        check()
        return _C.LinearPlan(
            _dlpack(w_u.detach().contiguous()),
            _dlpack(w_c.detach().contiguous()),
            _dlpack(None if bias is None else bias.detach().contiguous()),
            _current_stream(w_c),
        )

    weights = (w_c, w_u) if bias is None else (w_c, w_u, bias)
    return _CACHE.get("LinearPlan", weights, (), build)


# Replaying a captured graph with a new mapping would reuse the captured map.
_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


_LIBRARY = torch.library.Library("ikbo", "FRAGMENT")


def _below_autograd(op: torch._ops.OpOverload, keyset, args: tuple) -> Any:
    """Runs ``op`` on the kernels under its Autograd one (``keyset`` has no
    autograd keys)."""
    with torch._C._AutoDispatchBelowAutograd():
        return op.redispatch(keyset, *args)


class _NoBackward(torch.autograd.Function):
    """An op's call when an input requires grad: the op runs below autograd,
    and its output's backward raises."""

    @staticmethod
    def forward(ctx, op, keyset, *args):
        ctx.op_name = op.name()
        return _below_autograd(op, keyset, args)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            f"{ctx.op_name} is inference-only: no autograd formula is registered for it, "
            "so there is no backward through it"
        )


# torch's C check of its arguments (tensors and tensor lists), where it has one.
_any_requires_grad = getattr(torch._C, "_any_requires_grad", None) or (
    lambda *args: any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
)


def _autograd_kernel(op: torch._ops.OpOverload) -> Callable:
    """The op's Autograd kernel: straight to the backend kernel, or through
    :class:`_NoBackward` when an input requires grad."""
    below_autograd = torch._C._after_autograd_keyset

    def kernel(keyset, *args):
        keyset = keyset & below_autograd
        if torch.is_grad_enabled() and _any_requires_grad(*args):
            return _NoBackward.apply(op, keyset, *args)
        return _below_autograd(op, keyset, args)

    return kernel


def _op(name: str, schema: str) -> Callable:
    """Defines ``ikbo::name`` (schema: its arguments and result) with the
    decorated function as its kernel on every device, and returns the op.

    Registered with ``torch.library.Library`` rather than ``custom_op``, whose
    per-call wrappers (an aliasing check, a Dynamo guard, the autograd
    layer's metadata) took 2-4.6 µs an op (``bench/diagnostics/op_overhead.py``);
    what ``custom_op`` adds otherwise is here: the Autograd kernel above, and
    :func:`_fake` for tracing."""

    def register(function: Callable) -> torch._ops.OpOverloadPacket:
        _LIBRARY.define(name + schema, tags=_TAGS)
        packet = getattr(torch.ops.ikbo, name)
        _LIBRARY.impl(name, function, "CompositeExplicitAutograd")
        _LIBRARY.impl(name, _autograd_kernel(packet.default), "Autograd", with_keyset=True)
        return packet

    return register


def _fake(name: str) -> Callable:
    """Registers the decorated function as ``ikbo::name``'s fake (meta)
    implementation: the output's shape and the checks that tracing can make."""
    return torch.library.register_fake(f"ikbo::{name}", lib=_LIBRARY)


@_op(
    "lce",
    "(Tensor w_c, Tensor w_u, Tensor e_c, Tensor e_u, Tensor cand_to_user, "
    "Tensor[]? levels=None) -> Tensor",
)
def lce(
    w_c: torch.Tensor,
    w_u: torch.Tensor,
    e_c: torch.Tensor,
    e_u: torch.Tensor,
    cand_to_user: torch.Tensor,
    levels: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """``out[b] = w_c @ e_c[b] + w_u @ e_u[cand_to_user[b]]``.

    w_c ``[M, Kc]``, w_u ``[M, Ku]``, e_c ``[B, Kc, N]``, e_u ``[U, Ku, N]``
    (U = ``e_u.shape[0]``, which may be 0 only when B is), cand_to_user ``[B]``;
    returns ``[B, M, N]``. One dtype (float16, bfloat16, float32) and device for
    all; fp32 accumulation, the two partial products summed in fp32 and rounded
    once. The weights are prepared on the first call and reused while unchanged.
    ``levels``: the candidates reach the users through groups (see
    :func:`candidate_map`); the map composes them.
    """
    _check_tensors(w_c=w_c, w_u=w_u, e_c=e_c, e_u=e_u, cand_to_user=cand_to_user)
    if _rows(e_u) == 0:  # no users, so no candidates: nothing for the library to do
        return _lce_fake(w_c, w_u, e_c, e_u, cand_to_user, levels)

    def check() -> None:
        _check_lce(w_c, w_u, e_c, e_u, cand_to_user)

    _checked_before_copies(check, e_u, 3, e_c, e_u, cand_to_user)
    plan = _lce_plan(w_c, w_u, check)
    mapping = candidate_map(cand_to_user, e_u.shape[0], levels)
    return _lce(plan, None, e_c.contiguous(), e_u.contiguous(), mapping)


@_fake("lce")
def _lce_fake(w_c, w_u, e_c, e_u, cand_to_user, levels=None):
    _check_lce(w_c, w_u, e_c, e_u, cand_to_user)
    _check_levels(levels or (), cand_to_user.device)
    return e_c.new_empty((e_c.shape[0], w_c.shape[0], e_c.shape[2]))


@_op(
    "attention",
    "(Tensor q, Tensor k, Tensor v, Tensor cand_to_user, Tensor? kv_offsets=None, "
    "float? scale=None, Tensor[]? levels=None) -> Tensor",
)
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cand_to_user: torch.Tensor,
    kv_offsets: torch.Tensor | None = None,
    scale: float | None = None,
    levels: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """``out[b, :, h, :] = softmax(scale * q[b, :, h, :] @ k_u[:, h, :]^T) @ v_u[:, h, :]``
    with ``u = cand_to_user[b]``, non-causal.

    q ``[B, n_seed, H, D]`` (D in {64, 128, 256}); k, v dense ``[U, S, H, D]``, or
    jagged ``[total, H, D]`` with kv_offsets ``[U + 1]`` (a user without rows
    gets zeros, as does a query row whose every key scores -inf, where torch's
    softmax gives NaN; U may be 0 only when B is); scale defaults to
    ``1 / sqrt(D)``. Returns q's shape. Note the layout: torch's
    ``scaled_dot_product_attention`` takes ``[B, H, L, D]``, which is
    ``q.transpose(1, 2)`` of this one. ``levels`` as for :func:`lce`.
    """
    _check_tensors(q=q, k=k, v=v, cand_to_user=cand_to_user)
    if kv_offsets is None:
        no_users = _rows(k) == 0
    else:
        _check_tensors(kv_offsets=kv_offsets)
        no_users = _rows(kv_offsets) <= 1
    if no_users:  # no candidates either: nothing for the library to do
        return _attention_fake(q, k, v, cand_to_user, kv_offsets, scale, levels)

    def check() -> None:
        _check_attention(q, k, v, cand_to_user, kv_offsets, scale)

    rank = 4 if kv_offsets is None else 3
    _checked_before_copies(check, k, rank, q, k, v, cand_to_user, kv_offsets)
    if kv_offsets is None:
        offsets, num_users = None, k.shape[0]
    else:
        offsets = _jagged_offsets(kv_offsets, k.shape[0])
        num_users = offsets.num_users
    mapping = candidate_map(cand_to_user, num_users, levels)
    return _attention(
        q.contiguous(), k.contiguous(), v.contiguous(), mapping, kv_offsets=offsets, scale=scale
    )


@_fake("attention")
def _attention_fake(q, k, v, cand_to_user, kv_offsets=None, scale=None, levels=None):
    _check_attention(q, k, v, cand_to_user, kv_offsets, scale)
    _check_levels(levels or (), cand_to_user.device)
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@_op(
    "linear",
    "(Tensor w_c, Tensor w_u, Tensor x_c, Tensor x_u, Tensor cand_to_user, Tensor? bias=None, "
    "Tensor[]? levels=None) -> Tensor",
)
def linear(
    w_c: torch.Tensor,
    w_u: torch.Tensor,
    x_c: torch.Tensor,
    x_u: torch.Tensor,
    cand_to_user: torch.Tensor,
    bias: torch.Tensor | None = None,
    levels: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """``y[b] = x_c[b] @ w_c^T + x_u[cand_to_user[b]] @ w_u^T + bias``: a linear
    layer over ``[user features | candidate features]`` without the replicated
    user rows.

    w_c ``[N_out, Kc]``, w_u ``[N_out, Ku]`` (column blocks of torch's weight,
    e.g. ``weight[:, :ku]`` and ``weight[:, ku:]``: views are recognized and
    prepared once), x_c ``[B, Kc]``, x_u ``[U, Ku]`` (U = ``x_u.shape[0]``,
    which may be 0 only when B is), bias ``[N_out]`` or None; returns
    ``[B, N_out]``. The user part, bias included, is computed once per user in
    fp32 and added in fp32, rounded once. ``levels`` as for :func:`lce`.
    """
    _check_tensors(w_c=w_c, w_u=w_u, x_c=x_c, x_u=x_u, cand_to_user=cand_to_user)
    if _rows(x_u) == 0:  # no users, so no candidates: nothing for the library to do
        return _linear_fake(w_c, w_u, x_c, x_u, cand_to_user, bias, levels)

    def check() -> None:
        _check_linear(w_c, w_u, x_c, x_u, cand_to_user, bias)

    _checked_before_copies(check, x_u, 2, x_c, x_u, cand_to_user)
    plan = _linear_plan(w_c, w_u, bias, check)
    mapping = candidate_map(cand_to_user, x_u.shape[0], levels)
    return _linear(plan, x_c.contiguous(), x_u.contiguous(), mapping)


@_fake("linear")
def _linear_fake(w_c, w_u, x_c, x_u, cand_to_user, bias=None, levels=None):
    _check_linear(w_c, w_u, x_c, x_u, cand_to_user, bias)
    _check_levels(levels or (), cand_to_user.device)
    return x_c.new_empty((x_c.shape[0], w_c.shape[0]))
