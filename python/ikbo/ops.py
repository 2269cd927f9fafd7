"""Framework-friendly entry points to the IKBO ops.

These wrap the bindings in ``ikbo._C``: they accept either prebuilt state
(:class:`~ikbo.LcePlan`, :class:`~ikbo.LinearPlan`, :class:`~ikbo.CandidateMap`,
:class:`~ikbo.JaggedOffsets`) or raw tensors to build it from, allocate a
missing output in the caller's framework (numpy, torch, cupy, or any array-API
library), allocate the CUDA workspace the same way, so the C++ op itself
never allocates, and run on the framework's current CUDA stream
(``torch.cuda.current_stream()``, cupy's current stream). To run on another
stream, use the framework's stream context (``with torch.cuda.stream(s):``).

Tensors are passed through DLPack without copies; they must be dense
row-major and aligned to their element size (a numpy array over a byte
buffer at an odd offset is not). Every argument is validated by the library
before anything is written: an invalid one raises ``ValueError`` naming it,
and a preallocated ``out`` is then left untouched.
"""

from __future__ import annotations

import contextlib
import numbers
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import _C

Array = Any  # any DLPack-capable tensor: numpy.ndarray, torch.Tensor, cupy.ndarray, ...


def _is_torch(value: Any) -> bool:
    # A torch tensor can only exist once torch is imported; never import it here.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _is_cupy(value: Any) -> bool:
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(value, cupy.ndarray)


_FLOATS = "float16, bfloat16 or float32"


def _exportable(tensor: Array, name: str, takes: str = _FLOATS) -> Array:
    """`tensor`, checked as argument `name`, which takes the dtypes `takes`:
    torch refuses to export tensors that require grad through DLPack, and
    these inference ops have no backward. Hand it to the bindings through
    `_dlpack`."""
    if not isinstance(tensor, np.ndarray) and not hasattr(tensor, "__dlpack__"):
        raise TypeError(
            f"{name} must be an array (numpy, or a DLPack tensor: torch, cupy, ...), "
            f"got {type(tensor).__name__}"
        )
    if isinstance(tensor, np.ndarray) and not tensor.dtype.isnative:
        raise ValueError(
            f"{name} has dtype {tensor.dtype.str}, of non-native byte order: pass "
            f"{name}.astype('{tensor.dtype.newbyteorder('=').str}')"
        )
    if isinstance(tensor, np.ndarray) and tensor.dtype.kind not in "biufc":
        # numpy exports only bool, integer, float and complex dtypes through
        # DLPack; nanobind would refuse the others (ml_dtypes' bfloat16 among
        # them) with a generic "incompatible function arguments" TypeError.
        if takes == _FLOATS and tensor.dtype.name == "bfloat16":
            raise ValueError(
                f"{name} is a numpy bfloat16 array (ml_dtypes), which numpy cannot export "
                f"through DLPack: pass bfloat16 data as a torch tensor, or {name} as "
                "float16 or float32"
            )
        raise ValueError(
            f"{name} has dtype {tensor.dtype.name}, which ikbo does not take: "
            f"{name} must be {takes}"
        )
    if _is_torch(tensor):
        if tensor.is_meta:
            raise ValueError(f"{name} is a meta tensor, which holds no values")
        if tensor.is_nested or tensor.layout != sys.modules["torch"].strided:
            got = "a nested tensor" if tensor.is_nested else f"layout {tensor.layout}"
            raise ValueError(f"{name} must be a dense (strided) tensor, got {got}")
        if tensor.is_quantized:
            raise ValueError(
                f"{name} is a quantized tensor (dtype {str(tensor.dtype).replace('torch.', '')}), "
                f"which ikbo does not take: {name} must be {takes}"
            )
        if tensor.requires_grad:
            tensor = tensor.detach()
    return tensor


def _dlpack(array: Array | None) -> Array | None:
    """What to hand the bindings for `array` (one `_exportable` passed, or a
    dense tensor of the torch layer's own): a torch tensor as the DLPack
    capsule of ``torch.utils.dlpack.to_dlpack``, made in C (nanobind would
    call ``Tensor.__dlpack__``, ~1.5 µs of Python per tensor, and an op hands
    over up to seven), a negative view resolved first (DLPack carries no
    negation flag); anything else as it is. Never for `storage`, which the
    object built keeps alive: a consumed capsule does not keep its memory. A
    torch without that legacy call gets its (resolved) tensor as it is."""
    if _is_torch(array):
        array = array.resolve_neg()
        to_dlpack = getattr(sys.modules["torch"].utils.dlpack, "to_dlpack", None)
        if to_dlpack is not None:
            return to_dlpack(array)
    return array


def _writable_output(out: Array) -> Array:
    # nanobind would refuse a read-only array too, but only with a generic
    # "incompatible function arguments" TypeError.
    if isinstance(out, np.ndarray) and not out.flags.writeable:
        raise ValueError("out must be writable, got a read-only numpy array")
    if _is_torch(out) and out.is_neg():
        raise ValueError(
            "out must hold its values, got a torch negative view (its writes would be negated)"
        )
    return _exportable(out, "out")


def _int32_input(indices: Array | Sequence[int], name: str) -> Array:
    # A list or tuple goes as it is: the bindings make it an int32 array.
    if isinstance(indices, (list, tuple)):
        return indices
    return _dlpack(_exportable(indices, name, "int32"))


def _scale(scale: Any) -> float | None:
    """``scale`` as the bindings take it; a string is no number here."""
    if scale is None:
        return None
    if not isinstance(scale, (str, bytes, bool)):
        with contextlib.suppress(TypeError, ValueError):
            return float(scale)
    raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")


def _checked_shape(tensor: Array, name: str, rank: int) -> tuple[int, ...]:
    """`tensor`'s shape, for a default read from it before the library has
    validated it; a wrong rank gets the library's message."""
    shape = tuple(tensor.shape)
    if len(shape) != rank:
        extents = ", ".join(str(extent) for extent in shape)
        raise ValueError(
            f"{name} must have {rank} dimensions, got {len(shape)} (shape [{extents}])"
        )
    return shape


def _user_feature_count(weight: Array, x_c: Array, x_u_shape: tuple[int, ...]) -> int:
    """Ku of torch's weight [N_out, Ku + Kc]: the width of x_u (shape
    `x_u_shape`, checked 2-D), which with the width of x_c must make up
    weight's columns. Checked here because a wrong Ku would otherwise be
    reported against x_c or num_user_features."""
    weight_shape, x_c_shape = tuple(weight.shape), tuple(x_c.shape)
    # Other ranks are the library's to report.
    if (
        len(weight_shape) == 2
        and len(x_c_shape) == 2
        and x_u_shape[1] + x_c_shape[1] != weight_shape[1]
    ):
        raise ValueError(
            f"x_u dimension 1 (Ku) plus x_c dimension 1 (Kc) must be {weight_shape[1]}, "
            f"the columns of weight [N_out, Ku + Kc] (shape {list(weight_shape)}), "
            f"got {x_u_shape[1]} + {x_c_shape[1]} "
            f"(x_u shape {list(x_u_shape)}, x_c shape {list(x_c_shape)})"
        )
    return x_u_shape[1]


def _current_stream(tensor: Array) -> int:
    """The cudaStream_t the caller's framework is issuing work on (0 on the CPU)."""
    if _is_torch(tensor) and tensor.is_cuda:
        torch = sys.modules["torch"]
        # What torch's compiled code calls for the raw handle: 0.2 µs where
        # torch.cuda.current_stream(), which builds a Stream object under a
        # device guard, takes 5 µs on the H200's host, on every op.
        raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw_stream is not None:
            return raw_stream(tensor.get_device())
        return torch.cuda.current_stream(tensor.device).cuda_stream
    if _is_cupy(tensor):
        with tensor.device:
            return sys.modules["cupy"].cuda.get_current_stream().ptr
    return 0


def _allocate(like: Array, shape: tuple[int, ...], raw_bytes: bool = False) -> Array:
    """An uninitialized array of `shape` in `like`'s framework and on its device,
    of `like`'s dtype, or of uint8 when `raw_bytes`.

    Allocating on the current stream (torch, cupy) is what makes freeing the
    workspace right after an asynchronous op safe: their caching allocators
    reuse a block only for work ordered after the op on that stream."""
    if _is_torch(like):
        torch = sys.modules["torch"]
        return torch.empty(
            shape, dtype=torch.uint8 if raw_bytes else like.dtype, device=like.device
        )
    if isinstance(like, np.ndarray):
        return np.empty(shape, dtype=np.uint8 if raw_bytes else like.dtype)
    if _is_cupy(like):
        cupy = sys.modules["cupy"]
        with like.device:
            return cupy.empty(shape, dtype=cupy.uint8 if raw_bytes else like.dtype)
    get_namespace = getattr(like, "__array_namespace__", None)
    if get_namespace is None:
        kind = f"{type(like).__module__}.{type(like).__qualname__}"
        raise TypeError(
            f"ikbo cannot allocate an output for inputs of type {kind}: it allocates for "
            "numpy, torch, cupy and array-API arrays (those with __array_namespace__); "
            "pass a preallocated, writable out= instead"
        )
    xp = get_namespace()
    return xp.empty(shape, dtype=xp.uint8 if raw_bytes else like.dtype, device=like.device)


def _device_storage(index: Array, nbytes: Callable[[int], int]) -> Array | None:
    """The `storage` of a map or offsets object built from `index` on a GPU,
    of nbytes(elements of index) bytes, from the caching allocator of its
    framework (torch, cupy): a build per request then costs no cudaMalloc and
    no cudaFree, and the memory is reused in stream order like any tensor's.
    None otherwise (the object allocates its own device copy, or has none on
    the CPU)."""
    if _is_torch(index) and index.is_cuda:
        elements = index.numel()
    elif _is_cupy(index):
        elements = index.size
    else:
        return None
    return _allocate(index, (nbytes(elements),), raw_bytes=True)


def _map_storage(cand_to_user: Array, num_users: int) -> Array | None:
    """`_device_storage` for the CandidateMap of `cand_to_user` and `num_users` users."""
    return _device_storage(
        cand_to_user, lambda elements: _C.CandidateMap.device_bytes(elements, num_users)
    )


def _offsets_storage(kv_offsets: Array) -> Array | None:
    """`_device_storage` for the JaggedOffsets of `kv_offsets` (U + 1 entries;
    fewer are the library's to report, which the size for one user leaves it)."""
    return _device_storage(
        kv_offsets, lambda elements: _C.JaggedOffsets.device_bytes(max(elements - 1, 1))
    )


def _candidate_map(
    cand_to_user_or_map: _C.CandidateMap | Array | Sequence[int],
    num_users: int | None,
    rows: int,
    rows_name: str,
    stream: int,
) -> _C.CandidateMap:
    """The map given, or one built for the `rows` users of the tensor that
    `rows_name` names (U, its dimension 0); an explicit `num_users` must
    agree with it, checked before the map sizes anything by it."""
    if num_users is not None and (
        isinstance(num_users, bool) or not isinstance(num_users, numbers.Integral)
    ):
        raise TypeError(f"num_users must be an int or None, got {type(num_users).__name__}")
    if isinstance(cand_to_user_or_map, _C.CandidateMap):
        if num_users is not None and num_users != cand_to_user_or_map.num_users:
            raise ValueError(
                f"num_users = {num_users} disagrees with the CandidateMap's "
                f"num_users = {cand_to_user_or_map.num_users}"
            )
        return cand_to_user_or_map
    if num_users is not None and num_users != rows:
        raise ValueError(f"num_users = {num_users} disagrees with {rows_name} = {rows} (U)")
    if rows == 0:
        raise ValueError(f"{rows_name} must be at least 1 (U, the users of the request), got 0")
    return _C.CandidateMap(
        _int32_input(cand_to_user_or_map, "cand_to_user"),
        rows,
        stream,
        storage=_map_storage(cand_to_user_or_map, rows),
    )


def lce(
    w_c_or_plan: _C.LcePlan | Array,
    w_u: Array | None,
    e_c: Array,
    e_u: Array,
    cand_to_user_or_map: _C.CandidateMap | Array | Sequence[int],
    num_users: int | None = None,
    out: Array | None = None,
) -> Array:
    """Linear compression of embeddings with in-kernel broadcast.

    ``out[b] = w_c @ e_c[b] + w_u @ e_u[cand_to_user[b]]``

    Args:
        w_c_or_plan: an :class:`~ikbo.LcePlan` (prepared once per weights and
            reused: the fast path), or ``w_c`` ``[M, Kc]``, from which a plan
            is prepared for this call only.
        w_u: ``[M, Ku]`` when ``w_c_or_plan`` is ``w_c``; ``None`` with a plan.
        e_c: candidate embeddings ``[B, Kc, N]``.
        e_u: user embeddings ``[U, Ku, N]``, one row per user (not per candidate).
        cand_to_user_or_map: a :class:`~ikbo.CandidateMap` (built once per
            request and shared by its ops), or the int32 mapping ``[B]``.
        num_users: U when building the map from raw indices; defaults to
            ``e_u.shape[0]``. With a prebuilt map it may be given as a check.
        out: optional preallocated ``[B, M, N]``; otherwise allocated in
            ``e_c``'s framework on its device.

    All tensors share one dtype (float16, bfloat16 or float32) and device.
    Products accumulate in fp32 and the two partial sums are added in fp32,
    rounded once. On CUDA the op is asynchronous on the current stream.

    Returns:
        ``out``.

    Raises:
        ValueError: an invalid argument (message names it); ``out`` untouched.
        TypeError: an argument that is no array; no ``out`` and inputs of a
            framework ikbo cannot allocate in.
    """
    e_c, e_u = _exportable(e_c, "e_c"), _exportable(e_u, "e_u")
    stream = _current_stream(e_c)
    if isinstance(w_c_or_plan, _C.LcePlan):
        if w_u is not None:
            raise ValueError(
                "w_u must be None when w_c_or_plan is an LcePlan (the plan holds both weights)"
            )
        plan = w_c_or_plan
    elif w_u is None:
        raise ValueError(
            "w_u is required when w_c_or_plan is the weight w_c rather than an LcePlan"
        )
    else:
        plan = _C.LcePlan(
            _dlpack(_exportable(w_c_or_plan, "w_c")), _dlpack(_exportable(w_u, "w_u")), stream
        )
    num_rows = _checked_shape(e_u, "e_u", 3)[0]
    candidate_map = _candidate_map(
        cand_to_user_or_map, num_users, num_rows, "e_u dimension 0", stream
    )
    # Validates e_c, e_u and the map against the plan, so nothing is allocated
    # from the shape of an invalid input.
    workspace_bytes = _C.lce_workspace_bytes(plan, _dlpack(e_c), _dlpack(e_u), candidate_map)
    if out is None:
        out = _allocate(e_c, (e_c.shape[0], plan.m, e_c.shape[2]))
    workspace = _allocate(e_c, (workspace_bytes,), raw_bytes=True) if workspace_bytes else None
    _C.lce(
        plan,
        _dlpack(e_c),
        _dlpack(e_u),
        candidate_map,
        _dlpack(_writable_output(out)),
        stream,
        _dlpack(workspace),
    )
    return out


def linear(
    weight_or_plan: _C.LinearPlan | Array,
    x_c: Array,
    x_u: Array,
    cand_to_user_or_map: _C.CandidateMap | Array | Sequence[int],
    bias: Array | None = None,
    num_user_features: int | None = None,
    out: Array | None = None,
) -> Array:
    """A linear layer over ``[user features | candidate features]`` with
    in-kernel broadcast.

    ``out[b] = x_c[b] @ w_c^T + x_u[cand_to_user[b]] @ w_u^T + bias``, i.e.
    ``torch.nn.functional.linear(cat([x_u[cand_to_user], x_c], -1), weight, bias)``
    with ``weight = [w_u | w_c]``, without replicating the user rows.

    Args:
        weight_or_plan: a :class:`~ikbo.LinearPlan` (prepared once per weights
            and reused: the fast path), or torch's ``weight``
            ``[N_out, Ku + Kc]``, from which a plan is prepared for this call
            only.
        x_c: candidate features ``[B, Kc]``.
        x_u: user features ``[U, Ku]``, one row per user (not per candidate).
        cand_to_user_or_map: a :class:`~ikbo.CandidateMap` (built once per
            request and shared by its ops), or the int32 mapping ``[B]``
            (U is taken from ``x_u.shape[0]``).
        bias: optional ``[N_out]`` with a raw ``weight``; ``None`` with a plan
            (the plan holds its bias).
        num_user_features: Ku, where ``weight``'s columns split into the user
            and the candidate blocks; defaults to ``x_u.shape[1]``. With a
            plan it may be given as a check.
        out: optional preallocated ``[B, N_out]``; otherwise allocated in
            ``x_c``'s framework on its device.

    All tensors share one dtype (float16, bfloat16 or float32) and device.
    The user part (bias included) is computed once per user in fp32 and added
    to the candidate part in fp32, rounded once. On CUDA the op is
    asynchronous on the current stream.

    Returns:
        ``out``.

    Raises:
        ValueError: an invalid argument (message names it); ``out`` untouched.
        TypeError: an argument that is no array; no ``out`` and inputs of a
            framework ikbo cannot allocate in.
    """
    x_c, x_u = _exportable(x_c, "x_c"), _exportable(x_u, "x_u")
    stream = _current_stream(x_c)
    x_u_shape = _checked_shape(x_u, "x_u", 2)
    if isinstance(weight_or_plan, _C.LinearPlan):
        plan = weight_or_plan
        if bias is not None:
            raise ValueError(
                "bias must be None when weight_or_plan is a LinearPlan (the plan holds the bias)"
            )
        if num_user_features is not None and num_user_features != plan.ku:
            raise ValueError(
                f"num_user_features = {num_user_features} disagrees with the LinearPlan's "
                f"ku = {plan.ku}"
            )
    else:
        weight = _exportable(weight_or_plan, "weight")
        if num_user_features is None:
            num_user_features = _user_feature_count(weight, x_c, x_u_shape)
        plan = _C.LinearPlan.from_concatenated(
            _dlpack(weight),
            num_user_features,
            _dlpack(None if bias is None else _exportable(bias, "bias")),
            stream,
        )
        if num_user_features != x_u_shape[1]:  # x_c would be named otherwise
            raise ValueError(
                f"num_user_features = {num_user_features} disagrees with x_u dimension 1 = "
                f"{x_u_shape[1]} (Ku)"
            )
    candidate_map = _candidate_map(
        cand_to_user_or_map, None, x_u_shape[0], "x_u dimension 0", stream
    )
    x_c_shape = tuple(x_c.shape)
    if (
        len(x_c_shape) == 2
        and x_c_shape[0] == candidate_map.num_candidates
        and x_u_shape[0] == candidate_map.num_users
    ):
        # Sized from the row counts alone, which the map vouches for: a
        # linear layer's kernel is short enough that exporting x_c and x_u a
        # second time shows. _C.linear validates every argument before it
        # writes anything.
        workspace_bytes = _C.linear_workspace_bytes(plan, x_c_shape[0], x_u_shape[0])
    else:
        # Raises the ValueError that names the argument.
        workspace_bytes = _C.linear_workspace_bytes(plan, _dlpack(x_c), _dlpack(x_u), candidate_map)
    if out is None:
        out = _allocate(x_c, (x_c.shape[0], plan.out_features))
    workspace = _allocate(x_c, (workspace_bytes,), raw_bytes=True) if workspace_bytes else None
    _C.linear(
        plan,
        _dlpack(x_c),
        _dlpack(x_u),
        candidate_map,
        _dlpack(_writable_output(out)),
        stream,
        _dlpack(workspace),
    )
    return out


def attention(
    q: Array,
    k: Array,
    v: Array,
    cand_to_user_or_map: _C.CandidateMap | Array | Sequence[int],
    kv_offsets: _C.JaggedOffsets | Array | Sequence[int] | None = None,
    scale: float | None = None,
    out: Array | None = None,
) -> Array:
    """Target attention from candidate queries onto their user's history,
    reading each user's K/V once instead of once per candidate.

    ``out[b, :, h, :] = softmax(scale * q[b, :, h, :] @ k_u[:, h, :]^T) @ v_u[:, h, :]``
    with ``u = cand_to_user[b]``; non-causal.

    Args:
        q: queries ``[B, n_seed, H, D]``, D in {64, 128, 256}.
        k, v: per-user keys and values, dense ``[U, S, H, D]`` or, with
            ``kv_offsets``, jagged ``[total, H, D]``.
        cand_to_user_or_map: a :class:`~ikbo.CandidateMap` or the int32
            mapping ``[B]``; a raw mapping gets U from ``k.shape[0]`` (dense)
            or from ``kv_offsets`` (jagged).
        kv_offsets: ``None`` for dense K/V; else a :class:`~ikbo.JaggedOffsets`
            or int32 offsets ``[U + 1]`` (user u owns rows
            ``offsets[u]:offsets[u + 1]`` of k and v). A user with no rows
            gets zeros, as does a query row whose every key scores -inf
            (where torch's softmax gives NaN).
        scale: softmax scale; defaults to ``1 / sqrt(D)``.
        out: optional preallocated ``[B, n_seed, H, D]``; otherwise allocated
            in ``q``'s framework on its device.

    All tensors share one dtype (float16, bfloat16 or float32) and device;
    softmax and accumulation run in fp32. On CUDA the op is asynchronous on
    the current stream. A call with fewer query tiles (128 query rows of
    one user and head) than a Hopper GPU can keep busy gets a workspace
    from ``q``'s framework, with which the kernel splits the tiles' keys
    across more SMs and combines the parts in a second launch.

    Returns:
        ``out``.

    Raises:
        ValueError: an invalid argument (message names it); ``out`` untouched.
        TypeError: an argument that is no array (or a ``scale`` that is no
            number); no ``out`` and inputs of a framework ikbo cannot allocate in.
    """
    q, k, v = _exportable(q, "q"), _exportable(k, "k"), _exportable(v, "v")
    stream = _current_stream(q)
    # Dense K/V [U, S, H, D] or jagged [total, H, D].
    num_rows = _checked_shape(k, "k", 4 if kv_offsets is None else 3)[0]
    if kv_offsets is not None and not isinstance(kv_offsets, _C.JaggedOffsets):
        kv_offsets = _C.JaggedOffsets(
            _int32_input(kv_offsets, "kv_offsets"),
            num_rows,
            stream,
            storage=_offsets_storage(kv_offsets),
        )
    users, users_name = (
        (num_rows, "k dimension 0")
        if kv_offsets is None
        else (kv_offsets.num_users, "kv_offsets' users")
    )
    candidate_map = _candidate_map(cand_to_user_or_map, None, users, users_name, stream)
    # Validates q, k, v and the map, so nothing is allocated from the shape
    # of an invalid input; nonzero when the call's keys split across SMs.
    workspace_bytes = _C.attention_workspace_bytes(
        _dlpack(q), _dlpack(k), _dlpack(v), candidate_map, kv_offsets
    )
    if out is None:
        out = _allocate(q, tuple(q.shape))
    workspace = _allocate(q, (workspace_bytes,), raw_bytes=True) if workspace_bytes else None
    _C.attention(
        _dlpack(q),
        _dlpack(k),
        _dlpack(v),
        candidate_map,
        _dlpack(_writable_output(out)),
        kv_offsets,
        _scale(scale),
        stream,
        _dlpack(workspace),
    )
    return out
