"""Inference-time rewrite: find user tensors replicated to the candidate batch and
hand their consumers to the IKBO ops, which broadcast inside the kernel instead.

The pass works on ``torch.fx`` graphs, whichever way they were made:
``torch.fx.symbolic_trace`` (torch functions, methods and modules),
``torch.export`` (ATen ops), or the graph ``torch.compile`` gives a backend.

A *broadcast* is a user tensor ``x_u [U, ...]`` replicated along dim 0 to the
B candidates by the candidate mapping, in any of these spellings:

- ``index_select(x_u, 0, idx)``, ``x_u[idx]``: ``cand_to_user = idx``;
- ``repeat_interleave(x_u, counts, dim=0)``: user u has ``counts[u]``
  consecutive candidates (an int count: every user has that many);
- ``x_u.unsqueeze(1).expand(U, R, ...).reshape(U * R, ...)``: R per user;
- ``x_u.expand(B, ...)`` of a one-user ``x_u [1, ...]``.

Multi-level broadcasts (user -> group -> candidate, say user -> vendor ->
item) are chains of index gathers, ``x_u[vendor_to_user][cand_to_vendor]``,
or one gather by the composed index, ``x_u[vendor_to_user[cand_to_vendor]]``.
Attention over them reads each user's K/V once, by the composed mapping; a
concat whose broadcasts all come from the users does too, and one that has
user features beside vendor features (``x_v[cand_to_vendor]``) is rewritten
at the vendor level, its user rows copied to the vendors only.

Rewritten consumers (weights may be parameters or graph inputs):

- LCE: ``bmm``/``matmul`` of one weight ``[M, Ku + Kc]`` (2-D, or expanded
  over the batch) with ``cat([broadcast, e_c], dim=1)`` (either order; several
  user or candidate operands are grouped) becomes ``ikbo::lce`` over the
  weight's column blocks;
- linear: ``F.linear`` / ``nn.Linear`` over ``cat([broadcast, x_c], -1)`` of
  2-D features becomes ``ikbo::linear``;
- attention: ``scaled_dot_product_attention(q, K, V)`` with K and V broadcast
  by one mapping (no mask, no dropout, not causal) becomes ``ikbo::attention``;
  SDPA's ``[B, H, L, D]`` layout is transposed to ikbo's ``[B, L, H, D]`` and
  back, and transposes that cancel are dropped;
- multi-head attention: an ``nn.MultiheadAttention`` call (or
  ``F.multi_head_attention_forward``, the form torch.compile records) whose
  key and value are broadcast by one mapping (batch-first, or seq-first
  through a transpose of the broadcast) becomes its query projection,
  K/V projections of the per-user tensors (run once per user),
  ``ikbo::attention`` and its output projection, where its attention
  weights are not read and it has no mask, no dropout in training, no
  ``add_bias_kv`` or ``add_zero_attn``. torch.export decomposes the module
  into ops that merge the batch with the heads, which the pass does not
  follow.

Before matching, a broadcast is moved below the ops after it that compute
each row from the same row alone, ``f(x_u[idx]) == f(x_u)[idx]``, so that
they run once per user and the broadcast reaches a consumer above: a
``Linear`` (``nn.Linear``, ``F.linear``, ``mm``/``addmm``/``matmul`` with a
shared matrix), elementwise activations and casts (``dropout`` only when not
training), ``softmax``/``layer_norm``/``rms_norm``/reductions over dims other
than 0, ``batch_norm`` with running statistics, batch-first transformer
encoders (``nn.TransformerEncoderLayer`` / ``nn.TransformerEncoder`` called
without masks, not training, or the layer's inference fast path that
torch.compile records; with dynamic shapes torch 2.11 breaks the graph
at that op, which gained fake-tensor support for them in
pytorch/pytorch#183916, so there it moves in static-shape graphs only),
views that keep dim 0 in front at the candidate count
(``unflatten``, ``view``/``reshape``, ``transpose``/``permute``, slicing past
dim 0, ...), elementwise ops whose other operand is shared by all rows (a
bias, a scale; or a broadcast by the same mapping, or through the same
levels spelled otherwise), and concats of
broadcasts. A broadcast with several such
consumers (K and V projections of one gathered history) is moved down each
branch; reads of its shape are answered from the per-user tensor. Anything
else stops it: an op that mixes rows (a reduction over dim 0, batch norm in
training mode, a matmul with a per-candidate tensor), an op the pass does not
know, or an in-place write near it. A move is kept only where it lets a
consumer be rewritten, and the report names the ops moved (or, for a
broadcast left, where moving it would stop and why).

Every rewrite is checked: the rewritten graph runs on copies of the sample
inputs, from the module's buffers as they were, and its outputs and the
buffers after the run must match the original's (relative Frobenius error
per output within a dtype tolerance t, and every element within
t * (|expected| + 8 rms)). A rewrite that fails alone is dropped,
with the moves it needed. Where the sample cannot tell a shared operand from
a per-candidate one (a one-row tensor of a one-candidate request), or an
in-place write may reach an operand the ikbo op reads, the consumer is left.
The pass prints a report of what it rewrote, and which broadcasts it left
and why.

Entry points: :func:`optimize` (a module or exported program plus sample
inputs) and :func:`backend` / :func:`make_backend` for ``torch.compile``.
The backend rewrites graphs of dynamic shapes as well as static ones: one
graph serves every request size, the rewritten ops read their sizes at run
time, and a decision the pass takes on a size (two user counts equal, a
reshape's leading size the candidate count) becomes one of the graph's
guards, so a request where it would go otherwise is compiled anew.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import operator
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata
from torch.utils._pytree import tree_flatten, tree_map

from . import torch_ops  # noqa: F401 -- registers the torch.ops.ikbo operators

__all__ = ["RewriteReport", "backend", "make_backend", "optimize"]

Node = torch.fx.Node

# Relative Frobenius error allowed between the original and the rewritten
# graph, per output dtype: both sides round once to the output dtype but sum
# in different orders, so this is about twice each side's own error.
DEFAULT_TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float32: 1e-4}

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ATTENTION_HEAD_DIMS = (64, 128, 256)

_aten = torch.ops.aten

# What each recognized node computes, whatever its spelling.
_FUNCTION_KINDS: dict[Any, str] = {
    torch.index_select: "index_select",
    _aten.index_select.default: "index_select",
    operator.getitem: "getitem",
    _aten.index.Tensor: "index",
    torch.repeat_interleave: "repeat_interleave",
    _aten.repeat_interleave.self_Tensor: "repeat_interleave",
    _aten.repeat_interleave.self_int: "repeat_interleave",
    _aten.expand.default: "expand",
    torch.cat: "cat",
    torch.concat: "cat",
    torch.concatenate: "cat",
    _aten.cat.default: "cat",
    torch.bmm: "bmm",
    _aten.bmm.default: "bmm",
    torch.matmul: "matmul",
    operator.matmul: "matmul",
    _aten.matmul.default: "matmul",
    F.linear: "linear",
    _aten.linear.default: "linear",
    F.scaled_dot_product_attention: "sdpa",
    _aten.scaled_dot_product_attention.default: "sdpa",
    torch.transpose: "transpose",
    torch.swapaxes: "transpose",
    torch.swapdims: "transpose",
    _aten.transpose.int: "transpose",
    torch.permute: "permute",
    _aten.permute.default: "permute",
    torch.reshape: "reshape",
    torch.flatten: "reshape",
    _aten.reshape.default: "reshape",
    _aten.view.default: "reshape",
    _aten._unsafe_view.default: "reshape",
    _aten.flatten.using_ints: "reshape",
}
_METHOD_KINDS = {
    "index_select": "index_select",
    "repeat_interleave": "repeat_interleave",
    "expand": "expand",
    "bmm": "bmm",
    "matmul": "matmul",
    "transpose": "transpose",
    "swapaxes": "transpose",
    "swapdims": "transpose",
    "permute": "permute",
    "reshape": "reshape",
    "view": "reshape",
    "flatten": "reshape",
}
# Positional parameter names per kind; ATen schemas call the input "self".
# Sizes of expand and reshape are not read: the recorded output shape says it.
_PARAMETERS = {
    "index_select": ("input", "dim", "index"),
    "getitem": ("input", "index"),
    "index": ("input", "indices"),
    "repeat_interleave": ("input", "repeats", "dim", "output_size"),
    "expand": ("input",),
    "reshape": ("input",),
    "cat": ("tensors", "dim"),
    "bmm": ("input", "mat2"),
    "matmul": ("input", "other"),
    "linear": ("input", "weight", "bias"),
    "sdpa": ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"),
    "transpose": ("input", "dim0", "dim1"),
    "permute": ("input", "dims"),
}
# Nodes of these kinds are pure, so the rewrite may delete them once unused.
_PURE_KINDS = frozenset(_PARAMETERS)


@dataclass(frozen=True)
class _Call:
    """A recognized node: what it computes and its arguments by name."""

    kind: str
    arguments: dict[str, Any]

    def get(self, name: str, default: Any = None) -> Any:
        return self.arguments.get(name, default)


def _recognize(node: Node) -> _Call | None:
    if node.op == "call_function":
        kind = _FUNCTION_KINDS.get(node.target)
    elif node.op == "call_method":
        kind = _METHOD_KINDS.get(node.target)
    else:
        kind = None
    if kind is None:
        return None
    names = _PARAMETERS[kind]
    arguments = dict(zip(names, node.args))
    if kind == "permute" and len(node.args) > 2:  # x.permute(0, 2, 1, 3)
        arguments["dims"] = tuple(node.args[1:])
    for name, value in node.kwargs.items():
        arguments["input" if name == "self" else name] = value
    return _Call(kind, arguments)


def _kind(node: Any) -> str | None:
    call = _recognize(node) if isinstance(node, Node) else None
    return call.kind if call else None


def _meta(node: Any) -> TensorMetadata | None:
    """Shape, dtype and strides recorded for a tensor-valued node (None otherwise)."""
    if not isinstance(node, Node):
        return None
    meta = node.meta.get("tensor_meta")
    return meta if isinstance(meta, TensorMetadata) else None


def _shape(node: Any) -> tuple[int, ...] | None:
    meta = _meta(node)
    return tuple(meta.shape) if meta is not None else None


def _all_equal(sizes: Sequence[Any]) -> bool:
    """Whether ``sizes`` are all equal. Sizes of a dynamic-shape graph are
    SymInts: comparing them guards the compiled graph on the outcome, so
    torch.compile recompiles, and the pass runs again, on a request where
    it differs."""
    return all(size == sizes[0] for size in sizes[1:])


def _graph_size(node: Node) -> Any:
    """The size a node of a torch.compile graph computes, as traced: an int,
    or a SymInt where the graph has dynamic shapes; None for other nodes."""
    value = node.meta.get("example_value")
    return value if isinstance(value, torch.SymInt) or type(value) is int else None


def _size_key(size: Any) -> Any:
    """A size as a hashable value: an int, or a SymInt's symbolic expression
    (equal for sizes the graph knows to be equal)."""
    return size.node.expr if isinstance(size, torch.SymInt) else size


def _normalize_dim(dim: Any, ndim: int) -> int | None:
    if not isinstance(dim, int) or not -ndim <= dim < ndim:
        return None
    return dim % ndim


# The torch.fx node kinds that call something; every other node is a graph
# input, a module attribute the graph reads, or the graph's result.
_CALL_OPS = ("call_function", "call_method", "call_module")


def _describe(node: Any) -> str:
    """How a node reads in the report: its name and what it calls."""
    if not isinstance(node, Node):
        return repr(node)
    if node.op not in _CALL_OPS:
        return node.name
    if isinstance(node.target, str):
        target = node.target
    elif isinstance(node.target, torch._ops.OpOverload):
        target = str(node.target)
    else:
        target = getattr(node.target, "__name__", str(node.target))
    return node.name if node.name.startswith(target) else f"{node.name} ({target})"


# ---------------------------------------------------------------------------
# Broadcasts: a user tensor replicated to the candidates, and its mapping


@dataclass(frozen=True)
class _Mapping:
    """How candidates map to users; equal mappings share one index tensor.

    kind "index": ``source`` is the index node; "composed": ``source`` is a
    tuple of index nodes applied in turn (``x[a][b]``: user -> group ->
    candidate), whose composition ``a[b]`` maps candidates to users (the
    ikbo ops take ``b`` and ``levels=[a]``);
    "counts": ``source`` is the per-user counts node; "uniform": every one
    of ``num_users`` users has ``source`` consecutive candidates (an int, or
    a node computing one); "single": one user, ``source`` is the number of
    candidates. Sizes are kept as :func:`_size_key` gives them, so that
    mappings hash and compare.
    """

    kind: str
    source: Any
    num_users: Any = 0

    def describe(self) -> str:
        source = self.source.name if isinstance(self.source, Node) else self.source
        if self.kind == "index":
            return f"cand_to_user = {_chain_name(_index_chain(self.source))}"
        if self.kind == "composed":
            return f"cand_to_user = {_chain_name(self.source)}"
        if self.kind == "counts":
            return f"per-user counts {source}"
        if self.kind == "uniform":
            return f"{source} candidates per user"
        return "one user"


@dataclass(frozen=True)
class _Broadcast:
    """``node`` replicates ``user`` ([U, ...]) to the candidates along dim 0.
    ``unit_dim``: where the pattern's ``user`` carries an inserted dim of
    size 1 that the per-user tensor does not have (None: it has none)."""

    node: Node
    user: Node
    mapping: _Mapping
    unit_dim: int | None = None
    # A broadcast the pass made by moving an original one below per-row ops:
    # the original broadcasts (by name), and the ops moved above the gather
    # (descriptions, in order, and node names).
    origins: tuple[str, ...] = ()
    moved: tuple[str, ...] = ()
    moved_names: frozenset[str] = frozenset()

    def origin_names(self) -> tuple[str, ...]:
        return self.origins or (self.node.name,)


def _integer_vector(node: Any) -> bool:
    meta = _meta(node)
    return meta is not None and len(meta.shape) == 1 and meta.dtype in (torch.int32, torch.int64)


def _row_index(call: _Call) -> Node | None:
    """The 1-D integer index of a dim-0 row gather, if ``call`` is one."""
    if call.kind == "index_select":
        shape = _shape(call.get("input"))
        if shape and _normalize_dim(call.get("dim"), len(shape)) == 0:
            index = call.get("index")
            return index if _integer_vector(index) else None
        return None
    if call.kind == "getitem":
        index = call.get("index")
        if isinstance(index, tuple):  # x[idx, :, ...]
            rest = index[1:]
            if not all(part == slice(None) or part is Ellipsis for part in rest):
                return None
            index = index[0] if index else None
        return index if _integer_vector(index) else None
    if call.kind == "index":
        indices = call.get("indices")
        if isinstance(indices, (list, tuple)) and len(indices) == 1:
            return indices[0] if _integer_vector(indices[0]) else None
    return None


def _row_gather(node: Any) -> tuple[Node, Node] | None:
    """(input, index) of a dim-0 row gather by a 1-D integer index."""
    call = _recognize(node) if isinstance(node, Node) else None
    index = _row_index(call) if call is not None else None
    source = call.get("input") if index is not None else None
    return (source, index) if isinstance(source, Node) else None


def _used_only_as_index(node: Node) -> bool:
    """Whether every user of ``node`` gathers rows by it (and not of it): a
    composed index such as ``vendor_to_user[cand_to_vendor]``, not a user
    tensor."""

    def gathers_by_it(user: Node) -> bool:
        gather = _row_gather(user)
        return gather is not None and gather[1] is node and gather[0] is not node

    return bool(node.users) and all(gathers_by_it(user) for user in node.users)


def _index_chain(index: Node) -> tuple[Node, ...]:
    """The indices an index composes, in turn: ``(a, b)`` for ``a[b]``."""
    gather = _row_gather(index)
    if gather is None or not _integer_vector(gather[0]):
        return (index,)
    return (*_index_chain(gather[0]), *_index_chain(gather[1]))


def _through_levels(broadcast: _Broadcast, broadcasts: dict[Node, _Broadcast]) -> _Broadcast:
    """``broadcast`` from the first level of a multi-level one: for
    ``x[a][b]`` (user -> group -> candidate) or ``x[a[b]]``, ``x`` by the
    composed mapping, so that attention reads each user's K/V once rather
    than each group's copy of it. Other broadcasts come back as they are."""
    if broadcast.mapping.kind != "index" or broadcast.unit_dim is not None:
        return broadcast
    chain, lifted = _index_chain(broadcast.mapping.source), broadcast
    inner = broadcasts.get(broadcast.user)
    while inner is not None and inner.mapping.kind == "index" and inner.unit_dim is None:
        chain = (*_index_chain(inner.mapping.source), *chain)
        lifted = dataclasses.replace(
            lifted,
            user=inner.user,
            origins=tuple(dict.fromkeys((*inner.origin_names(), *lifted.origin_names()))),
            moved=tuple(dict.fromkeys((*inner.moved, *lifted.moved))),
            moved_names=inner.moved_names | lifted.moved_names,
        )
        inner = broadcasts.get(inner.user)
    if len(chain) == 1:
        return broadcast
    return dataclasses.replace(lifted, mapping=_Mapping("composed", chain))


def _chain_name(chain: Sequence[Node]) -> str:
    """Indices applied in turn, as indexing spells them: ``a[b][c]``."""
    first, *then = chain
    return first.name + "".join(f"[{index.name}]" for index in then)


def _expand_size(node: Node, dim: int) -> Any:
    """The size argument of the expand ``node`` for ``dim``: an int, or the
    node that computes it (None when it cannot be read)."""
    sizes = node.kwargs.get("size", node.args[1:])
    if len(sizes) == 1 and isinstance(sizes[0], (list, tuple)):
        sizes = sizes[0]
    return sizes[dim] if dim < len(sizes) else None


def _find_broadcast(node: Node) -> _Broadcast | None:
    call = _recognize(node)
    shape = _shape(node)
    if call is None or not shape:
        return None
    source = call.get("input")
    source_shape = _shape(source)
    if source_shape is None:
        return None

    if call.kind == "reshape":
        # x_u.unsqueeze(1).expand(U, R, ...).reshape(U * R, ...)
        if _kind(source) != "expand":
            return None
        unit = _recognize(source).get("input")
        unit_shape = _shape(unit)
        num_users, repeats = source_shape[:2]
        if (
            unit_shape is None
            or len(source_shape) != len(shape) + 1
            or unit_shape != (num_users, 1, *source_shape[2:])
            or shape != (num_users * repeats, *source_shape[2:])
        ):
            return None
        # R as the graph computes it, where it does: a request may have another.
        size = _expand_size(source, 1)
        if isinstance(size, Node):
            repeats = size
        elif size != repeats:
            return None
        return _Broadcast(
            node, unit, _Mapping("uniform", repeats, _size_key(num_users)), unit_dim=1
        )

    if len(source_shape) != len(shape):
        return None
    index = _row_index(call)
    # Rows of a module's own tensor (an embedding table, say) are a lookup,
    # not a request's user tensor broadcast to its candidates.
    if index is not None and source.op != "get_attr" and not _used_only_as_index(node):
        return _Broadcast(node, source, _Mapping("index", index))
    if call.kind == "repeat_interleave":
        if _normalize_dim(call.get("dim"), len(shape)) != 0:
            return None
        repeats = call.get("repeats")
        if _integer_vector(repeats):
            return _Broadcast(node, source, _Mapping("counts", repeats))
        if isinstance(repeats, int) or (
            isinstance(repeats, Node)
            and (repeats.meta.get("type") is int or _graph_size(repeats) is not None)
        ):
            return _Broadcast(
                node, source, _Mapping("uniform", repeats, _size_key(source_shape[0]))
            )
        return None
    # One row to B: with B = 1 in the sample the expand changes nothing there,
    # and a source of one row per candidate would pass for one user.
    if (
        call.kind == "expand"
        and source_shape[0] == 1
        and source_shape[1:] == shape[1:]
        and (shape[0] > 1 or source.op == "get_attr")
    ):
        return _Broadcast(node, source, _Mapping("single", _size_key(shape[0])))
    return None


# ---------------------------------------------------------------------------
# Sinking: moving a broadcast below the ops that act on each row by itself
#
# f(x_u[idx]) == f(x_u)[idx] when row b of f's output is computed from row b
# of its input alone, with operands shared by every row (a Linear's weight, a
# bias, a norm's scale): a Linear, an activation, a norm over trailing dims, a
# view that keeps dim 0. Moving the gather below such ops runs them once per
# user, and brings the gather down to the interaction layer, where the
# matchers find it. Only ops in the tables below are moved, each after
# checks that it cannot mix rows; anything else stops the gather.

_PLAIN_TYPES = (
    int,
    float,
    bool,
    str,
    type(None),
    torch.Size,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    torch.SymInt,
    torch.SymFloat,
    torch.SymBool,
)


def _is_plain(value: Any) -> bool:
    """Whether ``value`` holds no tensor: constants, and nodes that compute
    numbers, sizes or dtypes."""
    if isinstance(value, Node):
        return _meta(value) is None and value.meta.get("type") in _PLAIN_TYPES
    if isinstance(value, (list, tuple)):
        return all(_is_plain(item) for item in value)
    if isinstance(value, slice):
        return all(_is_plain(part) for part in (value.start, value.stop, value.step))
    return not isinstance(value, torch.Tensor)


# What each per-row op is (see _row_op), and its positional parameter names
# (None: from the Python signature or the ATen schema).
_ROW_FUNCTIONS: dict[Any, tuple[str, tuple[str, ...] | None]] = {}
_ROW_METHODS: dict[str, tuple[str, tuple[str, ...]]] = {}
_GENERIC_PARAMETERS = ("input",)


def _row_rule(
    kind: str,
    parameters: tuple[str, ...] | None = None,
    functions: Sequence[Any] = (),
    methods: str = "",
    aten: str = "",
) -> None:
    """Registers ``functions``, the space-separated tensor ``methods`` and
    ATen ops (``aten``: "name" or "name.overload") as ops of ``kind``."""
    for function in functions:
        _ROW_FUNCTIONS[function] = (kind, parameters)
    for method in methods.split():
        _ROW_METHODS[method] = (kind, parameters or _GENERIC_PARAMETERS)
    for name in aten.split():
        packet, _, overload = name.partition(".")
        op = getattr(getattr(_aten, packet, None), overload or "default", None)
        if op is not None:
            _ROW_FUNCTIONS[op] = (kind, None)


def _attributes(owner: Any, names: str) -> list[Any]:
    return [getattr(owner, name) for name in names.split() if hasattr(owner, name)]


_UNARY = (
    "relu tanh sigmoid exp log neg abs sqrt rsqrt square erf sin cos reciprocal clamp clip clone"
)
_ACTIVATIONS = (
    "relu6 gelu silu mish elu selu celu leaky_relu hardtanh hardswish hardsigmoid softplus"
)
# Elementwise, one tensor operand, a new tensor.
_row_rule(
    "unary",
    functions=_attributes(torch, _UNARY)
    + _attributes(F, f"relu {_ACTIVATIONS} softsign tanh sigmoid logsigmoid"),
    methods=_UNARY,
    aten=f"{_UNARY} {_ACTIVATIONS} log_sigmoid _to_copy",
)
# Elementwise, one tensor operand; the result may be the input itself.
_row_rule(
    "alias",
    functions=[torch.detach],
    methods="contiguous detach float half bfloat16 double to type",
    aten="contiguous detach alias to.dtype to.dtype_layout",
)
_row_rule("dropout", functions=[F.dropout], aten="dropout")
_row_rule("softmax", functions=[F.softmax, F.log_softmax], aten="softmax.int log_softmax.int")
_row_rule("softmax", aten="_softmax _log_softmax")
_row_rule(
    "softmax",
    ("input", "dim", "dtype"),
    functions=[torch.softmax, torch.log_softmax],
    methods="softmax log_softmax",
)
_row_rule("normalize", functions=[F.normalize])
_REDUCTIONS = "sum mean amax amin logsumexp"
_row_rule(
    "reduce",
    ("input", "dim", "keepdim", "dtype"),
    functions=_attributes(torch, _REDUCTIONS),
    methods=_REDUCTIONS,
)
_row_rule("reduce", aten="sum.dim_IntList mean.dim amax amin logsumexp sum mean")
_row_rule("layer_norm", functions=[F.layer_norm], aten="layer_norm")
_row_rule("rms_norm", functions=_attributes(F, "rms_norm"), aten="rms_norm")
_row_rule("batch_norm", functions=[F.batch_norm], aten="batch_norm")
_row_rule("linear", ("input", "weight", "bias"), functions=[F.linear], aten="linear")
_row_rule("mm", ("input", "mat2"), functions=[torch.mm], methods="mm", aten="mm")
_row_rule(
    "addmm", ("input", "mat1", "mat2"), functions=[torch.addmm], methods="addmm", aten="addmm"
)
_row_rule(
    "matmul",
    ("input", "other"),
    functions=[torch.matmul, operator.matmul],
    methods="matmul",
    aten="matmul",
)
_row_rule("bmm", ("input", "mat2"), functions=[torch.bmm], methods="bmm", aten="bmm")
_BINARY = "add sub mul div maximum minimum pow"
_row_rule(
    "binary",
    ("input", "other"),
    functions=[operator.add, operator.sub, operator.mul, operator.truediv]
    + _attributes(torch, _BINARY),
    methods=_BINARY,
    aten="add.Tensor add.Scalar sub.Tensor sub.Scalar rsub.Tensor rsub.Scalar mul.Tensor "
    "mul.Scalar div.Tensor div.Scalar div.Tensor_mode maximum minimum pow.Tensor_Tensor "
    "pow.Tensor_Scalar",
)
_row_rule("cat", ("tensors", "dim"), functions=_attributes(torch, "cat concat concatenate"))
_row_rule("cat", aten="cat")
_row_rule(
    "unflatten",
    ("input", "dim", "sizes"),
    functions=[torch.unflatten],
    methods="unflatten",
    aten="unflatten.int",
)
_row_rule(
    "flatten",
    ("input", "start_dim", "end_dim"),
    functions=[torch.flatten],
    methods="flatten",
    aten="flatten.using_ints",
)
_row_rule("reshape", ("input", "shape"), functions=[torch.reshape], methods="view reshape")
_row_rule("reshape", aten="view reshape _unsafe_view")
_row_rule(
    "transpose",
    ("input", "dim0", "dim1"),
    functions=_attributes(torch, "transpose swapaxes swapdims"),
    methods="transpose swapaxes swapdims",
    aten="transpose.int",
)
_row_rule(
    "permute", ("input", "dims"), functions=[torch.permute], methods="permute", aten="permute"
)
_row_rule(
    "squeeze",
    ("input", "dim"),
    functions=[torch.squeeze],
    methods="squeeze",
    aten="squeeze.dim squeeze.dims squeeze",
)
_row_rule(
    "unsqueeze",
    ("input", "dim"),
    functions=[torch.unsqueeze],
    methods="unsqueeze",
    aten="unsqueeze",
)
_row_rule("slice", aten="slice.Tensor")
_row_rule(
    "select",
    ("input", "dim", "index"),
    functions=[torch.select],
    methods="select",
    aten="select.int",
)
_row_rule(
    "narrow",
    ("input", "dim", "start", "length"),
    functions=[torch.narrow],
    methods="narrow",
    aten="narrow",
)
_row_rule("getitem", ("input", "index"), functions=[operator.getitem])
# nn.TransformerEncoderLayer's inference fast path, as torch.compile records it.
_row_rule(
    "transformer_encoder",
    ("input", "embed_dim", "num_heads", "qkv_weight", "qkv_bias", "proj_weight", "proj_bias")
    + ("use_gelu", "norm_first", "eps", "norm_weight_1", "norm_bias_1", "norm_weight_2")
    + ("norm_bias_2", "ffn_weight_1", "ffn_bias_1", "ffn_weight_2", "ffn_bias_2", "mask")
    + ("mask_type",),
    functions=_attributes(torch, "_transformer_encoder_layer_fwd"),
)

_nn = torch.nn
_ROW_MODULES: dict[type, str] = {
    **dict.fromkeys(
        _attributes(
            _nn,
            "ReLU ReLU6 GELU SiLU Tanh Sigmoid LeakyReLU ELU SELU CELU Softplus Softsign Mish "
            "Hardswish Hardsigmoid Hardtanh LogSigmoid",
        ),
        "unary",
    ),
    **dict.fromkeys(
        _attributes(_nn, "Dropout Dropout1d Dropout2d Dropout3d AlphaDropout"), "dropout"
    ),
    **dict.fromkeys(_attributes(_nn, "BatchNorm1d BatchNorm2d BatchNorm3d"), "batch_norm"),
    **dict.fromkeys(_attributes(_nn, "Softmax LogSoftmax"), "softmax"),
    **dict.fromkeys(_attributes(_nn, "RMSNorm"), "rms_norm"),
    _nn.Linear: "linear",
    _nn.Identity: "alias",
    _nn.LayerNorm: "layer_norm",
    _nn.Flatten: "flatten",
    _nn.Unflatten: "unflatten",
    _nn.TransformerEncoderLayer: "transformer_encoder",
    _nn.TransformerEncoder: "transformer_encoder",
}

# Kinds whose result is a new tensor; the others may share the input's storage.
_FRESH_KINDS = frozenset(
    ("unary", "softmax", "normalize", "reduce", "layer_norm", "rms_norm", "batch_norm")
    + ("linear", "mm", "addmm", "matmul", "bmm", "binary", "cat", "transformer_encoder")
)
_IN_PLACE_OPERATORS = frozenset(
    (operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv)
    + (operator.ifloordiv, operator.imatmul, operator.ipow)
)


def _bind(node: Node, parameters: tuple[str, ...] | None) -> dict[str, Any]:
    """A call's arguments by parameter name (an ATen ``self`` is ``input``)."""
    if parameters is None:
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            parameters = tuple(argument.name for argument in target._schema.arguments)
        else:
            try:
                parameters = tuple(inspect.signature(target).parameters)
            except (TypeError, ValueError):
                parameters = _GENERIC_PARAMETERS
    names = [*parameters, *(f"_{i}" for i in range(len(parameters), len(node.args)))]
    arguments = dict(zip(names, node.args))
    arguments.update(node.kwargs)
    if "self" in arguments:
        arguments["input"] = arguments.pop("self")
    return arguments


def _module_arguments(kind: str, submodule: torch.nn.Module, features: Any) -> dict[str, Any]:
    """A module call's arguments, as the functional form of ``kind`` names them."""
    arguments = {"input": features, "inplace": getattr(submodule, "inplace", False)}
    if kind == "dropout":
        arguments.update(p=submodule.p, training=submodule.training)
    elif kind == "softmax":
        arguments["dim"] = submodule.dim
    elif kind == "flatten":
        arguments.update(start_dim=submodule.start_dim, end_dim=submodule.end_dim)
    elif kind == "unflatten":
        arguments.update(dim=submodule.dim, sizes=tuple(submodule.unflattened_size))
    elif kind in ("layer_norm", "rms_norm"):
        arguments["normalized_shape"] = tuple(submodule.normalized_shape)
    elif kind == "batch_norm":
        arguments.update(
            training=submodule.training,
            running_mean=submodule.running_mean,
            running_var=submodule.running_var,
        )
    elif kind == "transformer_encoder":
        layer = submodule.layers[0] if isinstance(submodule, _nn.TransformerEncoder) else submodule
        arguments.update(
            training=submodule.training and layer.dropout.p != 0,
            batch_first=layer.self_attn.batch_first,
        )
    return arguments


def _row_call(node: Node, module: torch.nn.Module) -> tuple[str, dict[str, Any]] | None:
    """(kind, arguments by name) of a node the per-row tables know."""
    if node.op == "call_module":
        try:
            submodule = module.get_submodule(node.target)
        except AttributeError:
            return None
        kind = _ROW_MODULES.get(type(submodule))
        if kind is None or len(node.args) != 1 or node.kwargs:
            return None
        return kind, _module_arguments(kind, submodule, node.args[0])
    if node.op == "call_method":
        rule = _ROW_METHODS.get(node.target)
    elif node.op == "call_function":
        try:
            rule = _ROW_FUNCTIONS.get(node.target)
        except TypeError:  # an unhashable callable
            rule = None
    else:
        rule = None
    if rule is None:
        return None
    kind, parameters = rule
    return kind, _bind(node, parameters)


def _in_place(node: Node, module: torch.nn.Module) -> bool:
    """Whether ``node`` writes into one of its tensor operands."""
    if node.op == "call_method":
        name = node.target
        return (name.endswith("_") and not name.startswith("_")) or name in (
            "__setitem__",
            "__iadd__",
            "__isub__",
            "__imul__",
            "__itruediv__",
        )
    if node.op == "call_module":
        try:
            return getattr(module.get_submodule(node.target), "inplace", False) is True
        except AttributeError:
            return False
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.is_mutable
    try:
        if target in _IN_PLACE_OPERATORS:
            return True
    except TypeError:
        pass
    name = getattr(target, "__name__", "")
    if name.endswith("_") and not name.startswith("_"):
        return True
    return _bind(node, None).get("inplace") is True or node.kwargs.get("out") is not None


def _fresh(node: Node, module: torch.nn.Module) -> bool:
    """Whether ``node``'s result is known to share no storage with its operands."""
    if node.op not in _CALL_OPS:  # an input, an attribute or the result: it aliases nothing
        return True
    if _in_place(node, module):
        return False
    call = _recognize(node)
    if call is not None and (
        call.kind in ("index_select", "index", "repeat_interleave", "sdpa")
        or (call.kind == "getitem" and _row_index(call) is not None)
    ):
        return True
    if str(node.target).startswith("ikbo."):
        return True
    found = _row_call(node, module)
    return found is not None and found[0] in _FRESH_KINDS


def _mutation_hazards(module: torch.fx.GraphModule) -> set[Node]:
    """Tensor nodes that an in-place op may modify: the operands of in-place
    ops and everything that may share storage with them (through views, or
    through ops the pass does not know). Reading their rows at another point
    of the graph could see other values, so the pass moves no gather across them."""
    pending: list[Node] = []
    for node in module.graph.nodes:
        if _in_place(node, module):
            pending.append(node)
            pending.extend(item for item in node.all_input_nodes if _meta(item) is not None)
    hazards: set[Node] = set()
    while pending:
        node = pending.pop()
        if node in hazards:
            continue
        hazards.add(node)
        if not _fresh(node, module):
            pending.extend(item for item in node.all_input_nodes if _meta(item) is not None)
        pending.extend(
            user for user in node.users if _meta(user) is not None and not _fresh(user, module)
        )
    return hazards


def _shared_by_rows(operand: Any, rank: int, rows: int) -> str | None:
    """None when the tensor ``operand``, broadcast against a ``rank``-D operand
    of ``rows`` rows, is the same for every row; else why not."""
    shape = _shape(operand)
    name = _describe(operand)
    if shape is None:
        return f"takes an operand {name} that the pass cannot read"
    if len(shape) > rank:
        return f"takes an operand {name} that adds leading dims"
    if len(shape) < rank or (shape[0] == 1 and rows > 1):
        return None
    if shape[0] == 1:
        return (
            f"takes an operand {name} that may have a row per candidate (the sample request "
            "has one candidate, so the pass cannot tell)"
        )
    return f"takes an operand {name} that has a row per candidate"


def _reads_candidate_count(value: Any, rows: int) -> bool:
    """Whether the size ``value`` is the candidate count: a literal equal to
    it, or dim 0 of a tensor with ``rows`` rows read from the graph."""
    if isinstance(value, bool) or not isinstance(value, (int, Node)):
        return False
    if isinstance(value, int):
        return value == rows
    if value.target is _candidate_rows:
        return True
    args = value.args
    if value.op == "call_function" and value.target is operator.getitem and len(args) == 2:
        source, index = args
        if not isinstance(source, Node) or isinstance(index, Node) or index != 0:
            return False
        if source.target is _candidate_shape:
            return True
        shape_of = (
            source.op == "call_function"
            and source.target is getattr
            and source.args[1:] == ("shape",)
        )
        size_of = source.op == "call_method" and source.target == "size" and len(source.args) == 1
        return (shape_of or size_of) and (_shape(source.args[0]) or (None,))[0] == rows
    size_call = (value.op == "call_method" and value.target == "size") or (
        value.target is _aten.sym_size.int
    )
    if size_call and len(args) == 2 and not isinstance(args[1], Node) and args[1] == 0:
        return (_shape(args[0]) or (None,))[0] == rows
    # A size torch.compile traced: a graph input or an expression of sizes.
    size = _graph_size(value)
    return size is not None and size == rows


def _getitem_keeps_rows(index: Any, rank: int) -> bool | None:
    """For ``x[index]`` with x ``rank``-D: True when every row stays whole and
    in place, False when dim 0 is indexed, None when unsure."""
    items = index if isinstance(index, tuple) else (index,)
    if not all(item is Ellipsis or _is_plain(item) for item in items):
        return None  # tensor indices
    if not items:
        return True
    first = items[0]
    if first is Ellipsis:
        rest = items[1:]
        if any(item is Ellipsis for item in rest):
            return None
        return sum(1 for item in rest if item is not None) < rank
    return isinstance(first, slice) and first == slice(None)


def _reshape_sizes(node: Node, arguments: dict[str, Any]) -> Any:
    if node.op == "call_method":
        sizes = node.args[1:] or node.kwargs.get("shape", node.kwargs.get("size"))
        if isinstance(sizes, tuple) and len(sizes) == 1 and isinstance(sizes[0], (list, tuple)):
            sizes = sizes[0]
        if isinstance(sizes, tuple) and len(sizes) == 1 and isinstance(sizes[0], Node):
            sizes = sizes[0]
        return sizes
    return arguments.get("shape", arguments.get("size"))


@dataclass
class _RowOp:
    """A per-row op: ``data`` are its operands read row by row (each a
    broadcast, all by one mapping); ``rebuild`` makes the per-user node from
    the per-user operands (None: a copy of the node with them substituted)."""

    data: tuple[Node, ...]
    rebuild: Callable[[torch.fx.Graph, dict[Node, Node]], Node] | None = None
    # The operands are multi-level broadcasts spelled differently (x[a][b]
    # beside y[a[b]]): the op runs on their first level's tensors.
    through_levels: bool = False


def _row_kind_check(
    kind: str,
    node: Node,
    arguments: dict[str, Any],
    gathered: Node,
    broadcasts: dict[Node, _Broadcast],
) -> _RowOp | str | None:
    """The kind-specific half of :func:`_row_op`."""
    x = arguments.get("input")
    rank = len(_shape(x) or ())
    out_rank = len(_shape(node))
    rows = _shape(gathered)[0]

    def others_plain(*data: str) -> bool:
        return all(_is_plain(value) for name, value in arguments.items() if name not in data)

    def dims(value: Any, ndim: int) -> list[int | None]:
        items = value if isinstance(value, (list, tuple)) else [value]
        return [_normalize_dim(item, ndim) for item in items]

    if kind in ("unary", "alias"):
        return _RowOp((x,)) if others_plain("input") else None
    if kind == "dropout":
        if (
            arguments.get("training", arguments.get("train", True)) is not False
            and arguments.get("p", 0.5) != 0
        ):
            return "drops values at random per candidate (dropout in training mode)"
        return _RowOp((x,)) if others_plain("input") else None
    if kind in ("softmax", "normalize"):
        dim = arguments.get("dim", 1 if kind == "normalize" else None)
        if dim is None:
            return "normalizes over an implicit dim"
        normalized = _normalize_dim(dim, rank)
        if normalized == 0:
            return "normalizes over dim 0, mixing candidates"
        return _RowOp((x,)) if normalized is not None and others_plain("input") else None
    if kind == "reduce":
        dim = arguments.get("dim")
        if dim is None or (isinstance(dim, (list, tuple)) and not dim):
            return "reduces over every dim, dim 0 included, mixing candidates"
        normalized = dims(dim, rank)
        if 0 in normalized:
            return "reduces over dim 0, mixing candidates"
        return _RowOp((x,)) if None not in normalized and others_plain("input") else None
    if kind in ("layer_norm", "rms_norm"):
        shape = arguments.get("normalized_shape")
        shape = (shape,) if isinstance(shape, int) else shape
        if not isinstance(shape, (list, tuple)):
            return None
        if len(shape) >= rank:
            return "normalizes over dim 0 too, mixing candidates"
        return _RowOp((x,))
    if kind == "batch_norm":
        if (
            arguments.get("training", False) is not False
            or arguments.get("running_mean") is None
            or arguments.get("running_var") is None
        ):
            return (
                "normalizes with statistics over the whole batch (training mode, or no running "
                "statistics), mixing candidates"
            )
        return _RowOp((x,)) if rank >= 2 else None
    if kind in ("linear", "mm"):
        if rank < 2:
            return "contracts over dim 0, mixing candidates"
        return _RowOp((x,))
    if kind == "transformer_encoder":
        # Each sequence attends within itself: rows stay apart, called
        # batch-first without masks, and without dropout.
        if arguments.get("training", False) is not False:
            return "drops values at random per candidate (dropout in training mode)"
        if arguments.get("batch_first", True) is not True or rank != 3:
            return "takes the sequence along dim 0 (batch_first=False)"
        if arguments.get("mask") is not None:
            return "has a mask, which may differ per candidate"
        return _RowOp((x,))
    if kind == "addmm":
        bias = arguments.get("input")
        reason = None if _is_plain(bias) else _shared_by_rows(bias, 2, rows)
        if reason:
            return reason
        plain = all(_is_plain(arguments.get(name)) for name in ("beta", "alpha"))
        return _RowOp((arguments.get("mat1"),)) if plain else None
    if kind in ("matmul", "bmm"):
        first = arguments.get("input")
        second = arguments.get("other", arguments.get("mat2"))
        ranks = (len(_shape(first) or ()), len(_shape(second) or ()))
        if first in broadcasts and second in broadcasts and ranks[0] == ranks[1] >= 3:
            return _RowOp((first, second))
        if kind == "bmm":
            other = second if gathered is first else first
            return f"pairs each candidate with its own matrix from {_describe(other)}"
        if gathered is first:
            if ranks[0] < 2:
                return "contracts over dim 0, mixing candidates"
            if ranks[1] <= 2:
                return _RowOp((first,))
            return _shared_by_rows(second, ranks[0], rows) or _RowOp((first,))
        if gathered is second:
            if ranks[1] < 3:
                return "contracts over dim 0, mixing candidates"
            if ranks[0] <= 2:
                return _RowOp((second,))
            return _shared_by_rows(first, ranks[1], rows) or _RowOp((second,))
        return None
    if kind == "binary":
        data = []
        for name in ("input", "other", "exponent"):
            if name not in arguments:
                continue
            operand = arguments[name]
            if isinstance(operand, Node) and operand in broadcasts:
                if len(_shape(operand)) != out_rank:
                    return "broadcasts the rows against extra leading dims"
                data.append(operand)
            elif not _is_plain(operand):
                reason = _shared_by_rows(operand, out_rank, rows)
                if reason:
                    return reason
        if not others_plain("input", "other", "exponent"):
            return None
        return _RowOp(tuple(data))
    if kind == "cat":
        tensors = arguments.get("tensors")
        if not isinstance(tensors, (list, tuple)):
            return None
        (dim,) = dims(arguments.get("dim", 0), out_rank)
        if dim == 0:
            return "joins along dim 0"
        if dim is None:
            return None
        if not all(isinstance(item, Node) and item in broadcasts for item in tensors):
            return None  # candidate operands: the LCE and linear matchers take those
        return _RowOp(tuple(tensors))
    if kind == "unflatten":
        dim = dims(arguments.get("dim"), rank)
        if dim == [0]:
            return "splits dim 0"
        return _RowOp((x,)) if dim != [None] and others_plain("input") else None
    if kind == "flatten":
        start = dims(arguments.get("start_dim", 0), rank)
        if start == [0]:
            return "flattens dim 0 into the others"
        return _RowOp((x,)) if start != [None] and others_plain("input") else None
    if kind == "reshape":
        sizes = _reshape_sizes(node, arguments)
        if isinstance(sizes, Node):
            return f"takes its target shape from {_describe(sizes)} as a whole"
        if not isinstance(sizes, (list, tuple)) or not sizes or not _is_plain(list(sizes)):
            return None
        if any(isinstance(size, (torch.dtype, bool)) for size in sizes):
            return None
        leading, tail = sizes[0], tuple(sizes[1:])
        inferred = [size for size in tail if isinstance(size, int) and size == -1]
        by_rows = (isinstance(leading, int) and leading == -1 and not inferred) or (
            _reads_candidate_count(leading, rows)
        )
        if not by_rows:
            return (
                f"sets dim 0 to {_describe(leading)}, which it does not read as the candidate count"
            )

        def rebuild(graph: torch.fx.Graph, per_user: dict[Node, Node]) -> Node:
            return graph.call_function(_reshape_rows, (per_user[x], *tail))

        return _RowOp((x,), rebuild)
    if kind == "transpose":
        swapped = dims([arguments.get("dim0"), arguments.get("dim1")], rank)
        if 0 in swapped:
            return "moves dim 0"
        return _RowOp((x,)) if None not in swapped else None
    if kind == "permute":
        order = arguments.get("dims")
        if node.op == "call_method":
            order = node.args[1:] or node.kwargs.get("dims")
        if isinstance(order, tuple) and len(order) == 1 and isinstance(order[0], (list, tuple)):
            order = order[0]
        if not isinstance(order, (list, tuple)) or not order:
            return None
        normalized = dims(order, rank)
        if normalized[0] != 0:
            return "moves dim 0"
        return _RowOp((x,)) if None not in normalized else None
    if kind == "squeeze":
        dim = arguments.get("dim")
        if dim is None:
            return "squeezes every dim of size 1, which drops dim 0 for a request with one user"
        normalized = dims(dim, rank)
        if 0 in normalized:
            return "squeezes dim 0"
        return _RowOp((x,)) if None not in normalized else None
    if kind == "unsqueeze":
        (dim,) = dims(arguments.get("dim"), rank + 1)
        if dim == 0:
            return "inserts a dim before dim 0"
        return _RowOp((x,)) if dim is not None else None
    if kind in ("slice", "select", "narrow"):
        (dim,) = dims(arguments.get("dim", 0), rank)
        if dim is None or not others_plain("input"):
            return None
        if dim != 0:
            return _RowOp((x,))
        whole = (
            kind == "slice"
            and arguments.get("start") in (None, 0)
            and arguments.get("step", 1) in (None, 1)
            and (arguments.get("end") is None or _is_huge(arguments.get("end")))
        )
        return _RowOp((x,)) if whole else f"{'slices' if kind == 'slice' else 'indexes'} dim 0"
    if kind == "getitem":
        keeps = _getitem_keeps_rows(arguments.get("index"), rank)
        if keeps is False:
            return "indexes dim 0"
        return _RowOp((x,)) if keeps else None
    return None


def _is_huge(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 2**62


def _row_op(
    node: Node,
    gathered: Node,
    module: torch.nn.Module,
    broadcasts: dict[Node, _Broadcast],
    hazards: set[Node],
) -> _RowOp | str | None:
    """How ``node``, a user of the broadcast ``gathered``, computes each row
    of its output from the same row of its broadcast operands: a
    :class:`_RowOp` when it can run on the per-user rows before the gather;
    a reason when it cannot (it mixes rows, or the pass cannot show that it
    does not); None for an op the pass does not know."""
    found = _row_call(node, module)
    out = _shape(node)
    if found is None or not out:
        return None
    kind, arguments = found
    if _in_place(node, module) or arguments.get("inplace") is True:
        return "works in place"
    if arguments.get("out") is not None:
        return "writes into an out= tensor"
    result = _row_kind_check(kind, node, arguments, gathered, broadcasts)
    if not isinstance(result, _RowOp):
        return result
    if gathered not in result.data:
        return "reads the gathered tensor as a whole, not row by row"
    sources = [broadcasts.get(item) for item in result.data]
    if not all(sources):
        return None
    if len({source.mapping for source in sources}) != 1:
        lifted = [_through_levels(source, _unmodified(broadcasts, hazards)) for source in sources]
        if len({source.mapping for source in lifted}) != 1 or lifted[0].mapping.kind != "composed":
            return "takes operands gathered by different mappings"
        sources = lifted
        result = dataclasses.replace(result, through_levels=True)
    if not _all_equal([_shape(source.user)[0] for source in sources]):
        return "takes operands gathered from different numbers of users"
    if out[0] != _shape(gathered)[0]:
        return "changes dim 0"
    for source in sources:
        for item in (source.node, source.user):
            if item in hazards:
                return f"reads {item.name}, which an in-place op may modify"
    if node in hazards:
        return "has a result that an in-place op may modify"
    return result


def _unmodified(broadcasts: dict[Node, _Broadcast], hazards: set[Node]) -> dict[Node, _Broadcast]:
    """The broadcasts that no in-place op may modify, nor their user tensors."""
    return {
        node: item
        for node, item in broadcasts.items()
        if node not in hazards and item.user not in hazards
    }


def _output_size(broadcast: _Broadcast) -> dict[str, Any]:
    """The ``output_size`` a gather by counts was given (it spares torch the
    sum of the counts, a synchronization, and keeps the size traceable), as
    keyword arguments for the calls that stand in for it."""
    call = _recognize(broadcast.node) if broadcast.mapping.kind == "counts" else None
    size = call.get("output_size") if call is not None else None
    return {} if size is None else {"output_size": size}


def _candidate_rows(per_user: torch.Tensor, kind: str, source: Any) -> int:
    """The candidate count of a broadcast of ``per_user`` by a mapping of
    ``kind`` (see :class:`_Mapping`) from ``source``."""
    if kind == "index":
        return source.shape[0]
    if kind == "composed":
        return source[-1].shape[0]
    if kind == "counts":
        return source.sum().item()
    if kind == "uniform":
        return per_user.shape[0] * source
    return source


def _candidate_shape(per_user: torch.Tensor, rows: int) -> torch.Size:
    """The shape of ``per_user`` broadcast to ``rows`` candidates."""
    return torch.Size((rows, *per_user.shape[1:]))


def _reshape_rows(rows: torch.Tensor, *sizes: Any) -> torch.Tensor:
    """Reshapes each row of ``rows`` by itself to ``sizes``."""
    return rows.reshape(rows.shape[0], *sizes)


def _metadata_read(node: Node, tensor: Node) -> str | None:
    """What ``node`` reads of ``tensor`` without its values: "shape", "rows"
    (the dim-0 size), "same" (dtype, device, rank, another dim's size: what
    the per-user tensor has too), or None when it reads more."""
    args = node.args
    if not args or args[0] is not tensor or tensor in args[1:] or tensor in node.kwargs.values():
        return None
    rank = len(_shape(tensor) or ())

    def whole_shape() -> str:
        # Only sizes past dim 0 read from it: those the per-user tensor shares.
        later = [
            user.target is operator.getitem
            and len(user.args) == 2
            and isinstance(user.args[1], int)
            and _normalize_dim(user.args[1], rank) not in (None, 0)
            for user in node.users
        ]
        return "same" if later and all(later) else "shape"

    if node.op == "call_function" and node.target is getattr and len(args) == 2:
        if args[1] == "shape":
            return whole_shape()
        return "same" if args[1] in ("dtype", "device", "ndim", "layout", "is_cuda") else None
    if node.op == "call_method" and node.target == "size":
        dim = args[1] if len(args) > 1 else node.kwargs.get("dim")
        if dim is None:
            return whole_shape()
    elif node.target is _aten.sym_size.int and len(args) == 2:
        dim = args[1]
    elif node.op == "call_method" and node.target in ("dim", "ndimension", "get_device"):
        return "same" if len(args) == 1 and not node.kwargs else None
    elif isinstance(node.target, torch._ops.OpOverload) and (
        node.target.name() == "aten::_assert_tensor_metadata"
    ):
        bound = _bind(node, None)
        return "same" if bound.get("size") is None and bound.get("stride") is None else None
    else:
        return None
    dim = _normalize_dim(dim, rank)
    if dim is None:
        return None
    return "rows" if dim == 0 else "same"


def _dense(meta: TensorMetadata, rows: int) -> TensorMetadata:
    """``meta`` with ``rows`` rows, for a new row-major tensor."""
    shape = torch.Size((rows, *meta.shape[1:]))
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return meta._replace(shape=shape, stride=tuple(reversed(stride)))


def _describe_op(node: Node, module: torch.nn.Module) -> str:
    """A node as the report names a moved op: a module call with its class."""
    if node.op == "call_module":
        return f"{node.name} ({type(module.get_submodule(node.target)).__name__})"
    return _describe(node)


def _read_through_by_attention(node: Node, gathered: Node) -> bool:
    """Whether ``node`` swaps heads and tokens of ``gathered`` only for SDPA
    to read as K or V: the attention matcher reads through that swap, so the
    gather need not move below it."""
    if _swaps_heads_and_tokens(node) is not gathered or not node.users:
        return False
    for user in node.users:
        call = _recognize(user)
        if call is None or call.kind != "sdpa" or node is call.get("query"):
            return False
        if node not in (call.get("key"), call.get("value")):
            return False
    return True


class _Sinker:
    """Moves the broadcasts of one graph below the per-row ops after them
    (those named in ``allowed``; all when None), keeping ``broadcasts`` (the
    original ones and those made by moving) up to date."""

    def __init__(self, module: torch.fx.GraphModule, allowed: frozenset[str] | None) -> None:
        self.module = module
        self.graph = module.graph
        self.allowed = allowed
        self.broadcasts = {
            node: found for node in self.graph.nodes if (found := _find_broadcast(node)) is not None
        }
        self.hazards = _mutation_hazards(module)
        self.created: list[Node] = []
        self.squeezed: dict[Node, Node] = {}
        self.moved_from: set[Node] = set()
        self.descriptions: dict[Node, str] = {}

    def run(self) -> None:
        if self.allowed is not None and not self.allowed:
            return
        changed = True
        while changed:
            changed = False
            for node in list(self.graph.nodes):
                if node not in self.broadcasts:
                    continue
                for user in list(node.users):
                    if user not in node.users or _metadata_read(user, node):
                        continue
                    if self.allowed is not None and user.name not in self.allowed:
                        continue
                    if _read_through_by_attention(user, node):
                        continue
                    op = _row_op(user, node, self.module, self.broadcasts, self.hazards)
                    if isinstance(op, _RowOp):
                        self.move(user, op)
                        changed = True
                if node in self.moved_from:
                    self.rewrite_metadata_reads(node)
                    if not node.users:
                        self.erase(node)

    def per_user(self, broadcast: _Broadcast) -> Node:
        """The per-user tensor ``[U, ...]`` of ``broadcast``."""
        if broadcast.unit_dim is None:
            return broadcast.user
        user = broadcast.user
        if user not in self.squeezed:
            call = _row_call(user, self.module)
            if (
                call is not None
                and call[0] == "unsqueeze"
                and _normalize_dim(call[1].get("dim"), len(_shape(user))) == broadcast.unit_dim
            ):
                self.squeezed[user] = call[1]["input"]
            else:
                with self.graph.inserting_after(user):
                    node = self.graph.call_function(torch.select, (user, broadcast.unit_dim, 0))
                node.meta["tensor_meta"] = _dense(
                    _meta(user)._replace(
                        shape=torch.Size(
                            size
                            for dim, size in enumerate(_shape(user))
                            if dim != broadcast.unit_dim
                        )
                    ),
                    _shape(user)[0],
                )
                self.created.append(node)
                self.squeezed[user] = node
        return self.squeezed[user]

    def rows_source(self, broadcast: _Broadcast) -> Any:
        """What :func:`_candidate_rows` needs of ``broadcast``'s mapping."""
        if broadcast.mapping.kind != "single":
            return broadcast.mapping.source
        node = broadcast.node  # an expand of a one-row tensor
        sizes = node.args[1:] if node.op == "call_method" else node.args[1:2]
        if len(sizes) == 1 and isinstance(sizes[0], (list, tuple)):
            sizes = sizes[0]
        sizes = sizes or node.kwargs.get("size") or ()
        leading = sizes[0] if sizes else -1
        return broadcast.mapping.source if isinstance(leading, int) and leading < 0 else leading

    def regather(self, broadcast: _Broadcast, per_user: Node, rank: int) -> Node:
        """``per_user`` broadcast to the candidates as ``broadcast`` is."""
        mapping = broadcast.mapping
        if mapping.kind == "composed":  # level by level, each gather row-shaped
            node = per_user
            for level, index in enumerate(mapping.source):
                if level:
                    self.created.append(node)  # the caller records the last
                node = self.graph.call_function(operator.getitem, (node, index))
                node.meta = {"tensor_meta": _dense(_meta(per_user), _shape(index)[0])}
            return node
        if mapping.kind == "index":
            kind = _kind(broadcast.node)
            if kind == "index":
                return self.graph.call_function(_aten.index.Tensor, (per_user, [mapping.source]))
            if kind == "getitem":
                return self.graph.call_function(operator.getitem, (per_user, mapping.source))
            return self.graph.call_function(torch.index_select, (per_user, 0, mapping.source))
        if mapping.kind in ("counts", "uniform"):
            return self.graph.call_function(
                torch.repeat_interleave,
                (per_user, mapping.source),
                {"dim": 0, **_output_size(broadcast)},
            )
        sizes = (self.rows_source(broadcast), *([-1] * (rank - 1)))
        return self.graph.call_method("expand", (per_user, *sizes))

    def move(self, consumer: Node, op: _RowOp) -> None:
        """Runs ``consumer`` on the per-user rows and gathers its result."""
        found = {item: self.broadcasts[item] for item in op.data}
        if op.through_levels:
            unmodified = _unmodified(self.broadcasts, self.hazards)
            found = {item: _through_levels(source, unmodified) for item, source in found.items()}
        sources = list(dict.fromkeys(found.values()))
        first = sources[0]
        # An op moved again (above the next gather of a multi-level broadcast)
        # is told as the original op.
        description = self.descriptions.get(consumer) or _describe_op(consumer, self.module)
        out = _meta(consumer)
        with self.graph.inserting_before(consumer):
            per_user = {item: self.per_user(source) for item, source in found.items()}
            if op.rebuild is not None:
                node = op.rebuild(self.graph, per_user)
            else:
                node = self.graph.node_copy(consumer, lambda item: per_user.get(item, item))
            node.meta = {"tensor_meta": _dense(out, _shape(per_user[op.data[0]])[0])}
            gather = self.regather(first, node, len(out.shape))
            gather.meta = {"tensor_meta": _dense(out, out.shape[0])}
        self.created += [node, gather]
        self.descriptions[node] = description
        consumer.replace_all_uses_with(gather)
        # A broadcast of the moved op's result (the outer gather of x[a][b],
        # say, once moved below this op) now broadcasts the new gather.
        for key, item in self.broadcasts.items():
            if item.user is consumer:
                self.broadcasts[key] = dataclasses.replace(item, user=gather)
        if consumer in self.hazards:
            self.hazards.add(gather)
        name = consumer.name
        inputs = consumer.all_input_nodes
        self.graph.erase_node(consumer)
        for item in inputs:  # sizes that only the moved op read
            self.erase_dead_reads(item)
        self.broadcasts[gather] = _Broadcast(
            gather,
            node,
            first.mapping,
            origins=tuple(dict.fromkeys(o for source in sources for o in source.origin_names())),
            moved=(*dict.fromkeys(m for source in sources for m in source.moved), description),
            moved_names=frozenset({name}).union(*(source.moved_names for source in sources)),
        )
        self.moved_from.update(op.data)

    def rewrite_metadata_reads(self, gathered: Node) -> None:
        """Reads of ``gathered``'s shape, dtype, ... from the per-user tensor
        instead, so that the gather is not kept for them."""
        broadcast = self.broadcasts[gathered]
        for reader in list(gathered.users):
            what = _metadata_read(reader, gathered)
            if what is None:
                continue
            per_user = self.per_user(broadcast)
            if what == "same":
                reader.replace_input_with(gathered, per_user)
                continue
            with self.graph.inserting_before(reader):
                replacement = self.graph.call_function(
                    _candidate_rows,
                    (per_user, broadcast.mapping.kind, self.rows_source(broadcast)),
                )
                replacement.meta["type"] = int
                self.created.append(replacement)
                if what == "shape":
                    replacement = self.graph.call_function(
                        _candidate_shape, (per_user, replacement)
                    )
                    replacement.meta["type"] = torch.Size
                    self.created.append(replacement)
            reader.replace_all_uses_with(replacement)
            self.graph.erase_node(reader)

    def erase_dead_reads(self, node: Node) -> None:
        """Deletes ``node`` if it is an unused read of sizes (and so on up)."""
        reads = (operator.getitem, getattr, _candidate_rows, _candidate_shape, _aten.sym_size.int)
        if (
            node.users
            or _meta(node) is not None
            or node.meta.get("type") not in _PLAIN_TYPES
            or not (
                (node.op == "call_function" and node.target in reads)
                or (node.op == "call_method" and node.target == "size")
            )
        ):
            return
        inputs = node.all_input_nodes
        self.graph.erase_node(node)
        for item in inputs:
            self.erase_dead_reads(item)

    def erasable(self, node: Node) -> bool:
        """Whether the pass may delete ``node`` once unused: a gather, a view,
        or a per-row op without side effects."""
        if _kind(node) in _PURE_KINDS:
            return True
        found = _row_call(node, self.module)
        return found is not None and found[0] != "batch_norm" and not _in_place(node, self.module)

    def erase(self, gathered: Node) -> None:
        """Deletes the unused broadcast ``gathered`` and the pure nodes only it used."""
        pending = [gathered]
        while pending:
            node = pending.pop()
            if node._erased or node.users or node.op not in ("call_function", "call_method"):
                continue
            if node is not gathered and not self.erasable(node):
                continue
            inputs = node.all_input_nodes
            self.graph.erase_node(node)
            self.broadcasts.pop(node, None)
            pending.extend(inputs)


def _sink_gathers(
    module: torch.fx.GraphModule, allowed: frozenset[str] | None
) -> tuple[dict[Node, _Broadcast], list[Node]]:
    """Moves ``module``'s broadcasts below the per-row ops named in
    ``allowed`` (all it can when None), in place. Returns every broadcast of
    the result, and the nodes the moving made."""
    sinker = _Sinker(module, allowed)
    sinker.run()
    return sinker.broadcasts, sinker.created


# ---------------------------------------------------------------------------
# Matches: a consumer of broadcasts that an ikbo op replaces


class _Skip(Exception):
    """A consumer of ``broadcasts`` that cannot be rewritten; the message says why."""

    def __init__(self, reason: str, broadcasts: Sequence[_Broadcast]) -> None:
        super().__init__(reason)
        self.broadcasts = list(broadcasts)


@dataclass
class _Context:
    """What one application of the rewrites shares: the graph, the index
    tensor made for each mapping and the layout swap made for each attention
    operand (each made once, before its first use)."""

    graph: torch.fx.Graph
    indices: dict[_Mapping, Node] = field(default_factory=dict)
    swapped: dict[Node, Node] = field(default_factory=dict)

    def insert(self, target: Any, *args: Any) -> Node:
        return self.graph.call_function(target, args)

    def index(self, broadcast: _Broadcast, user: Node) -> Node:
        mapping = broadcast.mapping
        if mapping not in self.indices:
            if mapping.kind == "index":
                node = mapping.source
            elif mapping.kind == "composed":
                node = mapping.source[-1]  # candidates -> groups; levels() takes it on
            elif mapping.kind == "counts":
                node = self.graph.call_function(
                    torch.repeat_interleave, (mapping.source,), _output_size(broadcast)
                )
            elif mapping.kind == "uniform":
                node = self.insert(_uniform_user_index, user, mapping.source)
            else:
                node = self.insert(_single_user_index, broadcast.node)
            self.indices[mapping] = node
        return self.indices[mapping]

    @staticmethod
    def levels(broadcast: _Broadcast) -> tuple[list[Node], ...]:
        """The ikbo op's trailing ``levels`` argument for ``broadcast``: for a
        multi-level one, the index of each level above the candidates', up to
        the users (the op composes their maps and caches the result on these
        tensors, so a CUDA graph capture finds it); none otherwise."""
        mapping = broadcast.mapping
        return (list(reversed(mapping.source[:-1])),) if mapping.kind == "composed" else ()

    def user(self, broadcast: _Broadcast) -> Node:
        if broadcast.unit_dim is None:
            return broadcast.user
        return self.insert(torch.select, broadcast.user, broadcast.unit_dim, 0)

    def concat(self, nodes: Sequence[Node], dim: int) -> Node:
        return nodes[0] if len(nodes) == 1 else self.insert(torch.cat, list(nodes), dim)


def _single_user_index(candidates: torch.Tensor) -> torch.Tensor:
    """cand_to_user of a one-user request: all B rows of ``candidates`` map to user 0."""
    return torch.zeros(candidates.shape[0], dtype=torch.int32, device=candidates.device)


def _uniform_user_index(users: torch.Tensor, repeats: int) -> torch.Tensor:
    """cand_to_user when each of the U users of ``users`` has ``repeats``
    consecutive candidates."""
    user_ids = torch.arange(users.shape[0], dtype=torch.int32, device=users.device)
    return user_ids.repeat_interleave(repeats)


@dataclass
class _Match:
    """One rewritable consumer: ``consumer`` is replaced by ``op`` built by ``build``."""

    consumer: Node
    op: str
    broadcasts: list[_Broadcast]
    detail: str
    build: Callable[[_Context], Node]


def _dtype_of(node: Node) -> torch.dtype | None:
    meta = _meta(node)
    return meta.dtype if meta is not None else None


def _dtype_check(
    dtypes: Sequence[torch.dtype | None], what: str, broadcasts: Sequence[_Broadcast]
) -> None:
    dtypes = set(dtypes) - {None}
    if len(dtypes) != 1:
        raise _Skip(f"{what} mix dtypes {sorted(str(d) for d in dtypes)}", broadcasts)
    (dtype,) = dtypes
    if dtype not in _SUPPORTED_DTYPES:
        raise _Skip(f"{what} are {dtype}; ikbo takes float16, bfloat16 or float32", broadcasts)


@dataclass
class _ConcatSplit:
    """A concat of user broadcasts and candidate tensors along the feature dim."""

    broadcasts: list[_Broadcast]
    candidates: list[Node]
    user_first: bool
    user_width: int
    candidate_width: int

    def users(self) -> list[Node]:
        return [item.user for item in self.broadcasts]


def _split_concat(
    concat: Node, broadcasts: dict[Node, _Broadcast], feature_dim: int, rank: int
) -> _ConcatSplit | None:
    """None when ``concat`` is no concat of a broadcast; raises _Skip when it is
    one that cannot be split into a user block and a candidate block."""
    call = _recognize(concat)
    if call is None or call.kind != "cat":
        return None
    operands = list(call.get("tensors") or ())
    found = [broadcasts.get(operand) for operand in operands]
    if not any(found):
        return None
    involved = [item for item in found if item]
    shape = _shape(concat)
    if shape is None or len(shape) != rank:
        raise _Skip(
            f"the concat {concat.name} is {len(shape or ())}-D, expected {rank}-D", involved
        )
    dim = call.get("dim", 0)
    if _normalize_dim(dim, rank) != feature_dim:
        raise _Skip(
            f"the concat {concat.name} joins dim {dim}, not the feature dim {feature_dim}",
            involved,
        )
    user_first = found[0] is not None
    block = found[: len(involved)] if user_first else found[len(found) - len(involved) :]
    if not all(block):
        raise _Skip(f"user and candidate operands of {concat.name} interleave", involved)
    if len(involved) == len(operands):
        raise _Skip(f"every operand of {concat.name} is per-user; no candidate operand", involved)
    # Multi-level broadcasts from their first level where every one of them
    # has the same levels; else (user features beside group features) from
    # the level they share.
    lifted = [_through_levels(item, broadcasts) for item in block]
    if len({item.mapping for item in lifted}) == 1:
        block = lifted
    if len({item.mapping for item in block}) != 1:
        raise _Skip(f"the operands of {concat.name} are broadcast by different mappings", involved)
    if not _all_equal([_shape(item.user)[0] for item in block]):
        raise _Skip(f"the user operands of {concat.name} have different user counts", involved)
    candidates = [operand for operand, item in zip(operands, found) if item is None]
    user_width = sum(_shape(item.node)[feature_dim] for item in block)
    candidate_width = sum(_shape(node)[feature_dim] for node in candidates)
    return _ConcatSplit(list(block), candidates, user_first, user_width, candidate_width)


def _column_blocks(
    context: _Context, weight: Node, split: _ConcatSplit, users: Node, candidates: Node
) -> tuple[Node, Node]:
    """Views (w_c, w_u) of a weight whose columns follow the concat's order;
    a width a dynamic-shape graph leaves symbolic is read from the concat of
    the ``users`` or ``candidates`` operands at run time."""

    def width(value: Any, operand: Node) -> Any:
        return value if isinstance(value, int) else context.graph.call_method("size", (operand, 1))

    user_width = width(split.user_width, users)
    candidate_width = width(split.candidate_width, candidates)
    user_start = 0 if split.user_first else candidate_width
    candidate_start = user_width if split.user_first else 0
    w_u = context.insert(torch.narrow, weight, 1, user_start, user_width)
    w_c = context.insert(torch.narrow, weight, 1, candidate_start, candidate_width)
    return w_c, w_u


def _is_one_matrix(shape: tuple[int, ...] | None) -> bool:
    return shape is not None and (len(shape) == 2 or (len(shape) == 3 and shape[0] == 1))


def _shared_weight(node: Node, split: _ConcatSplit, rows: int) -> Node:
    """The [M, K] (or [1, M, K]) matrix a matmul operand applies to every one
    of the sample's ``rows`` candidates."""
    shape = _shape(node) or ()
    matrix = None
    if _is_one_matrix(shape):
        matrix = node
    elif _kind(node) == "expand":
        source = _recognize(node).get("input")
        if _is_one_matrix(_shape(source)):
            matrix = source
    if matrix is not None:
        # [1, M, K] of a one-candidate sample may as well be [B, M, K]: one
        # matrix per candidate. A module's own weight is one matrix.
        if len(_shape(matrix)) == 3 and rows == 1 and matrix.op != "get_attr":
            raise _Skip(
                f"the weight operand {node.name} may have a matrix per candidate (the sample "
                "request has one candidate, so the pass cannot tell)",
                split.broadcasts,
            )
        return matrix
    raise _Skip(
        f"the weight operand {node.name} {list(shape)} is not one [M, K] matrix shared by all "
        "candidates",
        split.broadcasts,
    )


def _match_lce(node: Node, broadcasts: dict[Node, _Broadcast]) -> _Match | None:
    call = _recognize(node)
    if call is None or call.kind not in ("bmm", "matmul"):
        return None
    weight_operand = call.get("input")
    concat = call.get("mat2" if call.kind == "bmm" else "other")
    split = _split_concat(concat, broadcasts, feature_dim=1, rank=3)
    if split is None:
        return None
    weight = _shared_weight(weight_operand, split, _shape(concat)[0])
    weight_shape = _shape(weight)
    _dtype_check(
        [_dtype_of(node) for node in (weight, *split.users(), *split.candidates)],
        "the weight and embeddings",
        split.broadcasts,
    )

    def build(context: _Context) -> Node:
        matrix = weight
        if len(weight_shape) == 3:
            matrix = context.insert(torch.select, weight, 0, 0)
        users = [context.user(item) for item in split.broadcasts]
        index = context.index(split.broadcasts[0], users[0])
        e_u = context.concat(users, 1)
        e_c = context.concat(split.candidates, 1)
        w_c, w_u = _column_blocks(context, matrix, split, e_u, e_c)
        levels = context.levels(split.broadcasts[0])
        return context.insert(torch.ops.ikbo.lce.default, w_c, w_u, e_c, e_u, index, *levels)

    detail = (
        f"weight {weight.name} [{weight_shape[-2]}, {weight_shape[-1]}] split into "
        f"Ku={split.user_width} user / Kc={split.candidate_width} candidate columns"
    )
    return _Match(node, "ikbo::lce", split.broadcasts, detail, build)


@dataclass
class _LinearOperands:
    """A linear node's operands; for an ``nn.Linear`` module call the weight
    and bias are attribute paths (``"proj.weight"``), read with get_attr."""

    features: Node
    weight: Node | str
    bias: Node | str | None
    weight_dtype: torch.dtype | None

    def node(self, context: _Context, operand: Node | str | None) -> Node | None:
        return context.graph.get_attr(operand) if isinstance(operand, str) else operand


def _linear_operands(node: Node, module: torch.nn.Module) -> _LinearOperands | None:
    if node.op == "call_module":
        submodule = module.get_submodule(node.target)
        if type(submodule) is not torch.nn.Linear or len(node.args) != 1 or node.kwargs:
            return None
        bias = f"{node.target}.bias" if submodule.bias is not None else None
        return _LinearOperands(node.args[0], f"{node.target}.weight", bias, submodule.weight.dtype)
    call = _recognize(node)
    if call is None or call.kind != "linear":
        return None
    weight = call.get("weight")
    return _LinearOperands(call.get("input"), weight, call.get("bias"), _dtype_of(weight))


def _match_linear(
    node: Node, broadcasts: dict[Node, _Broadcast], module: torch.nn.Module
) -> _Match | None:
    operands = _linear_operands(node, module)
    if operands is None:
        return None
    features = operands.features
    if _kind(features) != "cat":
        return None
    involved = [
        broadcasts[operand]
        for operand in _recognize(features).get("tensors") or ()
        if operand in broadcasts
    ]
    if not involved:
        return None
    rank = len(_shape(features) or ())
    if rank != 2:
        raise _Skip(
            f"the linear input {features.name} is {rank}-D; ikbo::linear takes [B, K]", involved
        )
    split = _split_concat(features, broadcasts, feature_dim=1, rank=2)
    _dtype_check(
        [operands.weight_dtype, *(_dtype_of(node) for node in (*split.users(), *split.candidates))],
        "the weight and features",
        split.broadcasts,
    )

    def build(context: _Context) -> Node:
        users = [context.user(item) for item in split.broadcasts]
        index = context.index(split.broadcasts[0], users[0])
        x_u = context.concat(users, 1)
        x_c = context.concat(split.candidates, 1)
        w_c, w_u = _column_blocks(context, operands.node(context, operands.weight), split, x_u, x_c)
        bias = operands.node(context, operands.bias)
        levels = context.levels(split.broadcasts[0])
        return context.insert(
            torch.ops.ikbo.linear.default, w_c, w_u, x_c, x_u, index, bias, *levels
        )

    weight_name = operands.weight if isinstance(operands.weight, str) else operands.weight.name
    detail = (
        f"weight {weight_name} split into Ku={split.user_width} user / "
        f"Kc={split.candidate_width} candidate columns"
    )
    return _Match(node, "ikbo::linear", split.broadcasts, detail, build)


def _swapped_input(node: Any, rank: int, first: int) -> Node | None:
    """The input of ``node`` when ``node`` only swaps dims ``first`` and
    ``first + 1`` of a ``rank``-D tensor."""
    call = _recognize(node) if isinstance(node, Node) else None
    shape = _shape(node)
    if call is None or shape is None or len(shape) != rank:
        return None
    if call.kind == "transpose":
        dims = {_normalize_dim(call.get("dim0"), rank), _normalize_dim(call.get("dim1"), rank)}
        return call.get("input") if dims == {first, first + 1} else None
    if call.kind == "permute":
        swapped = list(range(rank))
        swapped[first], swapped[first + 1] = first + 1, first
        dims = [_normalize_dim(dim, rank) for dim in call.get("dims") or ()]
        return call.get("input") if dims == swapped else None
    return None


def _swaps_heads_and_tokens(node: Any) -> Node | None:
    """The input of ``node`` when ``node`` only swaps dims 1 and 2 of a 4-D tensor."""
    return _swapped_input(node, 4, 1)


def _to_ikbo_layout(context: _Context, node: Node) -> Node:
    """[X, H, L, D] -> [X, L, H, D] (and back: the swap is its own inverse),
    dropping a transpose the graph already applied."""
    if node not in context.swapped:
        unswapped = _swaps_heads_and_tokens(node)
        context.swapped[node] = (
            unswapped if unswapped is not None else context.insert(torch.transpose, node, 1, 2)
        )
    return context.swapped[node]


def _attention_operand(
    node: Any, broadcasts: dict[Node, _Broadcast]
) -> tuple[_Broadcast, bool] | None:
    """(broadcast, already in ikbo's [B, S, H, D] layout) for SDPA's K or V."""
    if node in broadcasts:
        return _through_levels(broadcasts[node], broadcasts), False
    inner = _swaps_heads_and_tokens(node)
    if inner is not None and inner in broadcasts:
        return _through_levels(broadcasts[inner], broadcasts), True
    return None


def _match_attention(node: Node, broadcasts: dict[Node, _Broadcast]) -> _Match | None:
    call = _recognize(node)
    if call is None or call.kind != "sdpa":
        return None
    query = call.get("query")
    key = _attention_operand(call.get("key"), broadcasts)
    value = _attention_operand(call.get("value"), broadcasts)
    if key is None and value is None:
        return None
    involved = [found[0] for found in (key, value) if found is not None]

    def skip(reason: str) -> _Skip:
        return _Skip(reason, involved)

    if key is None or value is None:
        raise skip("only one of K and V is broadcast; ikbo attention needs both per user")
    if key[0].mapping != value[0].mapping:
        raise skip("K and V are broadcast by different mappings")
    if call.get("attn_mask") is not None:
        raise skip("SDPA has an attn_mask; ikbo attention masks only past a user's length")
    dropout = call.get("dropout_p", 0.0)
    if not isinstance(dropout, (int, float)) or dropout != 0:
        raise skip(f"SDPA has dropout_p={_describe(dropout)}; ikbo attention has no dropout")
    if call.get("is_causal", False) is not False:
        raise skip("SDPA is causal; ikbo attention is not")
    if call.get("enable_gqa", False) is not False:
        raise skip("SDPA uses grouped-query attention; ikbo attention takes equal head counts")
    scale = call.get("scale")
    if scale is not None and not isinstance(scale, (int, float)):
        raise skip(f"SDPA's scale {_describe(scale)} is computed in the graph, not a constant")
    query_shape = _shape(query)
    key_shape = _shape(call.get("key"))
    if query_shape is None or len(query_shape) != 4 or len(key_shape) != 4:
        raise skip("SDPA operands are not 4-D [B, H, L, D]")
    if query_shape[0] != key_shape[0]:
        raise skip(f"query has batch {query_shape[0]}, the broadcast K/V {key_shape[0]}")
    if query_shape[1] != key_shape[1]:
        raise skip(f"query has {query_shape[1]} heads, K/V {key_shape[1]}")
    if query_shape[3] not in _ATTENTION_HEAD_DIMS:
        dims = ", ".join(map(str, _ATTENTION_HEAD_DIMS))
        raise skip(f"head dim D={query_shape[3]}; ikbo attention takes D in {{{dims}}}")
    _dtype_check(
        [_dtype_of(node) for node in (query, key[0].user, value[0].user)],
        "query, keys and values",
        involved,
    )

    def build(context: _Context) -> Node:
        per_user = []
        for broadcast, in_ikbo_layout in (key, value):
            user = context.user(broadcast)
            per_user.append(user if in_ikbo_layout else _to_ikbo_layout(context, user))
        index = context.index(key[0], per_user[0])
        out = context.insert(
            torch.ops.ikbo.attention.default,
            _to_ikbo_layout(context, query),
            per_user[0],
            per_user[1],
            index,
            None,
            None if scale is None else float(scale),
            *context.levels(key[0]),
        )
        return context.insert(torch.transpose, out, 1, 2)

    detail = f"H={query_shape[1]}, D={query_shape[3]}, S={key_shape[2]}"
    return _Match(node, "ikbo::attention", [key[0], value[0]], detail, build)


@dataclass
class _MhaCall:
    """An ``nn.MultiheadAttention`` call, or ``F.multi_head_attention_forward``
    (the form torch.compile records): its arguments by the functional form's
    names, defaults included. Weights are nodes, or for a module call
    attribute paths (``"attn.in_proj_weight"``) read with get_attr, or None."""

    arguments: dict[str, Any]
    seq_first: bool  # query, key, value and the output are [L, B, E], not [B, L, E]
    weight_dtype: torch.dtype | None

    def get(self, name: str) -> Any:
        return self.arguments.get(name)

    def node(self, context: _Context, name: str) -> Node | None:
        operand = self.arguments.get(name)
        return context.graph.get_attr(operand) if isinstance(operand, str) else operand


def _bound_arguments(target: Callable, node: Node) -> dict[str, Any] | None:
    """``node``'s call of the Python function ``target`` bound to its
    signature, defaults included (unlike :func:`_bind`: an argument left out,
    ``is_causal`` say, reads as its default), or None where it does not bind."""
    try:
        bound = inspect.signature(target).bind(*node.args, **node.kwargs)
    except (TypeError, ValueError):
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


def _mha_call(node: Node, module: torch.nn.Module) -> _MhaCall | None:
    if node.op == "call_function" and node.target is F.multi_head_attention_forward:
        arguments = _bound_arguments(F.multi_head_attention_forward, node)
        if arguments is None:
            return None
        return _MhaCall(arguments, True, _dtype_of(arguments.get("out_proj_weight")))
    if node.op != "call_module":
        return None
    try:
        submodule = module.get_submodule(node.target)
    except AttributeError:
        return None
    if type(submodule) is not _nn.MultiheadAttention:
        return None
    arguments = _bound_arguments(submodule.forward, node)
    if arguments is None:
        return None

    arguments.update(
        num_heads=submodule.num_heads,
        bias_k=submodule.bias_k,
        bias_v=submodule.bias_v,
        add_zero_attn=submodule.add_zero_attn,
        dropout_p=submodule.dropout,
        training=submodule.training,
        use_separate_proj_weight=not submodule._qkv_same_embed_dim,
    )
    # The module registers the weights it does not use, and absent biases, as None.
    for name, path in (
        ("in_proj_weight", "in_proj_weight"),
        ("q_proj_weight", "q_proj_weight"),
        ("k_proj_weight", "k_proj_weight"),
        ("v_proj_weight", "v_proj_weight"),
        ("in_proj_bias", "in_proj_bias"),
        ("out_proj_weight", "out_proj.weight"),
        ("out_proj_bias", "out_proj.bias"),
    ):
        held = submodule
        for part in path.split("."):
            held = getattr(held, part, None)
        arguments[name] = f"{node.target}.{path}" if held is not None else None
    return _MhaCall(arguments, not submodule.batch_first, submodule.out_proj.weight.dtype)


def _output_without_weights(out: torch.Tensor) -> tuple[torch.Tensor, None]:
    """What ``nn.MultiheadAttention`` returns when its weights are not read."""
    return out, None


def _match_mha(
    node: Node, broadcasts: dict[Node, _Broadcast], module: torch.nn.Module
) -> _Match | None:
    call = _mha_call(node, module)
    if call is None:
        return None

    def operand(name: str) -> _Broadcast | None:
        value = call.get(name)
        inner = _swapped_input(value, 3, 0) if call.seq_first else value
        found = broadcasts.get(inner) if isinstance(inner, Node) else None
        return None if found is None else _through_levels(found, broadcasts)

    key, value = operand("key"), operand("value")
    if key is None and value is None:
        return None
    involved = [found for found in (key, value) if found is not None]

    def skip(reason: str) -> _Skip:
        return _Skip(reason, involved)

    if key is None or value is None:
        raise skip("only one of K and V is broadcast; ikbo attention needs both per user")
    if key.mapping != value.mapping:
        raise skip("K and V are broadcast by different mappings")
    for name in ("key_padding_mask", "attn_mask"):
        if call.get(name) is not None:
            raise skip(f"it has a {name}; ikbo attention masks only past a user's length")
    for name in ("bias_k", "bias_v", "static_k", "static_v"):
        if call.get(name) is not None:
            raise skip(f"it has {name} (add_bias_kv or static K/V); ikbo attention reads K/V alone")
    if call.get("add_zero_attn") is not False or call.get("is_causal") is not False:
        raise skip("it is causal or adds a zero key (add_zero_attn); ikbo attention does neither")
    dropout = call.get("dropout_p")
    if call.get("training") is not False and dropout != 0:
        raise skip(f"it has dropout_p={_describe(dropout)} in training; ikbo has no dropout")
    for user in node.users:
        output = user.op == "call_function" and user.target is operator.getitem
        if not output or (user.args[1] != 0 and user.users):
            raise skip(
                f"its attention weights are read ({_describe(user)}); ikbo attention "
                "returns the output alone"
            )
    query_shape, key_shape = _shape(call.get("query")), _shape(call.get("key"))
    if query_shape is None or key_shape is None or len(query_shape) != 3 or len(key_shape) != 3:
        raise skip("its query or key is not batched 3-D")
    batch = 1 if call.seq_first else 0
    if query_shape[batch] != key_shape[batch]:
        raise skip(f"query has batch {query_shape[batch]}, the broadcast K/V {key_shape[batch]}")
    embed_dim, heads = query_shape[2], call.get("num_heads")
    if type(embed_dim) is not int or type(heads) is not int or embed_dim % heads:
        raise skip(f"embed dim {embed_dim} over {_describe(heads)} heads")
    head_dim = embed_dim // heads
    if head_dim not in _ATTENTION_HEAD_DIMS:
        dims = ", ".join(map(str, _ATTENTION_HEAD_DIMS))
        raise skip(f"head dim D={head_dim}; ikbo attention takes D in {{{dims}}}")
    _dtype_check(
        [
            call.weight_dtype,
            *(_dtype_of(item) for item in (call.get("query"), key.user, value.user)),
        ],
        "query, keys, values and weights",
        involved,
    )

    def build(context: _Context) -> Node:
        def project(features: Node, weight: Node | None, bias: Node | None, block: int) -> Node:
            if not call.get("use_separate_proj_weight"):
                weight = context.insert(torch.narrow, weight, 0, block * embed_dim, embed_dim)
            if bias is not None:
                bias = context.insert(torch.narrow, bias, 0, block * embed_dim, embed_dim)
            projected = context.insert(F.linear, features, weight, bias)
            return context.insert(torch.unflatten, projected, -1, (heads, head_dim))

        packed = call.node(context, "in_proj_weight")
        bias = call.node(context, "in_proj_bias")
        query = call.get("query")
        if call.seq_first:
            query = _swapped_input(query, 3, 0) or context.insert(torch.transpose, query, 0, 1)
        per_user = [context.user(key), context.user(value)]
        weights = [
            packed if packed is not None else call.node(context, f"{which}_proj_weight")
            for which in "qkv"
        ]
        q = project(query, weights[0], bias, 0)
        k = project(per_user[0], weights[1], bias, 1)
        v = project(per_user[1], weights[2], bias, 2)
        index = context.index(key, per_user[0])
        out = context.insert(
            torch.ops.ikbo.attention.default, q, k, v, index, None, None, *context.levels(key)
        )
        out = context.insert(
            F.linear,
            context.insert(torch.flatten, out, 2),
            call.node(context, "out_proj_weight"),
            call.node(context, "out_proj_bias"),
        )
        if call.seq_first:
            out = context.insert(torch.transpose, out, 0, 1)
        return context.insert(_output_without_weights, out)

    detail = (
        f"multi-head attention H={heads}, D={head_dim}, S={key_shape[1 - batch]}; "
        "its K/V projections run once per user"
    )
    return _Match(node, "ikbo::attention", [key, value], detail, build)


# ---------------------------------------------------------------------------
# Applying, verifying and reporting


@dataclass
class Rewritten:
    """One consumer the pass replaced with an ikbo op."""

    node: str
    op: str
    broadcasts: list[str]
    mapping: str
    detail: str
    # Ops moved above the gather to reach the consumer, now run once per user.
    moved: list[str] = field(default_factory=list)


@dataclass
class Left:
    """A broadcast still computed in the result, and why."""

    node: str
    reason: str


@dataclass
class RewriteReport:
    """What :func:`optimize` did; ``str(report)`` is the printed text.
    ``max_error``: the largest relative error of the rewritten graph's outputs
    against the original's on the sample inputs."""

    tracer: str
    rewritten: list[Rewritten] = field(default_factory=list)
    left: list[Left] = field(default_factory=list)
    max_error: float = 0.0
    # Why no gather was moved, when moving them failed on this graph.
    warnings: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [
            (
                f"ikbo rewrite ({self.tracer} graph): {len(self.rewritten)} rewritten, "
                f"{len(self.left)} broadcast(s) left"
            )
        ]
        if self.rewritten:
            lines.append(
                "  outputs match the original on the sample inputs "
                f"(max relative error {self.max_error:.2e})"
            )
        for item in self.rewritten:
            moved = (
                f"; moved above the gather (now run once per user): {', '.join(item.moved)}"
                if item.moved
                else ""
            )
            lines.append(
                f"  rewrote {item.node} -> {item.op}: broadcast {', '.join(item.broadcasts)} "
                f"({item.mapping}); {item.detail}{moved}"
            )
        for item in self.left:
            lines.append(f"  left {item.node}: {item.reason}")
        for warning in self.warnings:
            lines.append(f"  note: {warning}")
        return "\n".join(lines)


# Why a broadcast's consumer cannot be rewritten: (that consumer, the message).
_Reasons = dict[Node, list[tuple[Node, str]]]


def _find_matches(
    module: torch.fx.GraphModule, broadcasts: dict[Node, _Broadcast] | None = None
) -> tuple[dict[Node, _Broadcast], list[_Match], _Reasons]:
    """Every broadcast (``broadcasts``, or those found in the graph), the
    consumers that can be rewritten, and for each broadcast the reasons its
    other consumers cannot."""
    if broadcasts is None:
        broadcasts = {
            node: found
            for node in module.graph.nodes
            if (found := _find_broadcast(node)) is not None
        }
    reasons: _Reasons = {}
    # A broadcast that an in-place op may modify is not what its user tensor
    # says it is: leave those to be computed as written.
    hazards = _mutation_hazards(module)
    matchable = {}
    for node, broadcast in broadcasts.items():
        modified = [item for item in (node, broadcast.user) if item in hazards]
        if modified:
            message = f"{modified[0].name} may be modified by an in-place op"
            reasons.setdefault(node, []).append((node, message))
        else:
            matchable[node] = broadcast
    matchers = (
        lambda node: _match_lce(node, matchable),
        lambda node: _match_linear(node, matchable, module),
        lambda node: _match_attention(node, matchable),
        lambda node: _match_mha(node, matchable, module),
    )
    matches: list[_Match] = []
    for node in module.graph.nodes:
        for matcher in matchers:
            try:
                match = matcher(node)
            except _Skip as skip:
                for item in skip.broadcasts:
                    reasons.setdefault(item.node, []).append((node, f"{_describe(node)}: {skip}"))
                break
            if match is not None:
                # The ikbo op reads its operands where the consumer stands: an
                # in-place write between their making and the consumer (a clamp_
                # of the concat, say) would be lost.
                modified = [item for item in _read_operands(node) if item in hazards]
                if modified:
                    message = (
                        f"{_describe(node)}: its operand {modified[0].name} may be modified "
                        "by an in-place op"
                    )
                    for item in match.broadcasts:
                        reasons.setdefault(item.node, []).append((node, message))
                else:
                    matches.append(match)
                break
    return broadcasts, matches, reasons


def _read_operands(node: Node) -> list[Node]:
    """The tensors a rewritten consumer reads: its operands, and the operands
    of the concats and layout views between them and it."""
    read = []
    for item in node.all_input_nodes:
        read.append(item)
        if _kind(item) in ("cat", "transpose", "permute", "expand"):
            read.extend(item.all_input_nodes)
    return read


def _stop_notes(
    module: torch.fx.GraphModule,
    broadcasts: dict[Node, _Broadcast],
    matches: Sequence[_Match],
    reasons: _Reasons,
    trial: bool,
) -> dict[Node, list[str]]:
    """For each broadcast, where its gather stops and why: at each user that
    is neither rewritten nor moved above it, and that provably mixes rows.
    ``trial``: the gathers were moved as far as they go to see where that
    leads, not to keep; tell that as what moving them would do."""
    hazards = _mutation_hazards(module)
    taken: dict[Node, set[Node]] = {}
    for match in matches:
        for item in match.broadcasts:
            taken.setdefault(item.node, set()).add(match.consumer)
    notes: dict[Node, list[str]] = {}
    for node, broadcast in broadcasts.items():
        consumers = taken.get(node, set())
        skipped = reasons.get(node, [])
        moving = f"moving it below {', '.join(broadcast.moved)} would bring it to"
        found = []
        for user in node.users:
            # The matchers look through a concat or a transpose to the consumer.
            if _metadata_read(user, node) or {user, *user.users} & consumers:
                continue
            messages = [message for consumer, message in skipped if consumer in (user, *user.users)]
            verdict = _row_op(user, node, module, broadcasts, hazards)
            if trial and broadcast.moved:
                if messages:
                    found += [f"{moving} {message}" for message in messages]
                else:
                    which = verdict if isinstance(verdict, str) else "ikbo does not rewrite"
                    found.append(f"{moving} {_describe(user)}, which {which}")
            elif isinstance(verdict, str) and not messages:
                found.append(f"the gather cannot move below {_describe(user)}, which {verdict}")
        if found:
            notes[node] = found
    return notes


@dataclass
class _Planned:
    """A consumer that is rewritable once gathers are moved: the ops to move
    (node names), and the original broadcasts it takes."""

    consumer: str
    op: str
    needs: frozenset[str]
    origins: tuple[str, ...]


@dataclass
class _Plan:
    """What moving every gather as far as it goes makes rewritable (by
    consumer name), and for each original broadcast (by name) where its
    moved gathers stop and why."""

    matches: dict[str, _Planned]
    notes: dict[str, list[str]]
    failure: str | None = None


def _plan(module: torch.fx.GraphModule) -> _Plan:
    """Moves every gather of a copy of ``module`` as far as it goes and finds
    the matches there, to learn which moves each rewrite needs."""
    trial = torch.fx.GraphModule(module, copy.deepcopy(module.graph))
    try:
        broadcasts, _ = _sink_gathers(trial, None)
        trial.graph.lint()
        broadcasts, matches, reasons = _find_matches(trial, broadcasts)
        stops = _stop_notes(trial, broadcasts, matches, reasons, True)
    except Exception as error:  # noqa: BLE001 -- a graph the mover cannot handle: match as is
        return _Plan(
            {}, {}, f"no gather was moved: moving them failed ({type(error).__name__}: {error})"
        )
    planned = {
        match.consumer.name: _Planned(
            _describe(match.consumer),
            match.op,
            frozenset().union(*(item.moved_names for item in match.broadcasts)),
            tuple(dict.fromkeys(o for item in match.broadcasts for o in item.origin_names())),
        )
        for match in matches
    }
    notes: dict[str, list[str]] = {}
    for node, found in stops.items():
        for origin in broadcasts[node].origin_names():
            notes.setdefault(origin, []).extend(found)
    return _Plan(planned, notes)


def _erase_unused(graph: torch.fx.Graph, consumer: Node) -> None:
    """Delete the replaced ``consumer`` and, transitively, the pure nodes
    (gathers, concats, views) that only it used."""
    pending, erased = [consumer], set()
    while pending:
        node = pending.pop()
        if node in erased or node.users:
            continue
        if node is not consumer and _kind(node) not in _PURE_KINDS:
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        erased.add(node)
        pending.extend(inputs)


@dataclass
class _Applied:
    """A rewritten copy: what was found in it and which matches were applied."""

    module: torch.fx.GraphModule
    broadcasts: dict[Node, _Broadcast]
    candidates: list[_Match]
    matches: list[_Match]
    reasons: _Reasons


def _rewrite(module: torch.fx.GraphModule, plan: _Plan, selected: set[str] | None) -> _Applied:
    """A copy of ``module`` (sharing its parameters) with the matches whose
    consumer is named in ``selected`` (all when None) replaced by ikbo ops,
    after moving the gathers below the per-row ops that those matches need
    moved (and no others). Node names survive the copy, so matches found on
    the original name the same consumers here."""
    result = torch.fx.GraphModule(module, copy.deepcopy(module.graph))
    names = plan.matches if selected is None else selected
    allowed = frozenset().union(
        *(plan.matches[name].needs for name in names if name in plan.matches)
    )
    broadcasts, created = _sink_gathers(result, allowed)
    broadcasts, matches, reasons = _find_matches(result, broadcasts)
    chosen = [m for m in matches if selected is None or m.consumer.name in selected]
    graph = result.graph
    context = _Context(graph)
    # In graph order, so an index tensor made for the first consumer of a
    # mapping is defined before every later one.
    for match in chosen:
        with graph.inserting_before(match.consumer):
            replacement = match.build(context)
        match.consumer.replace_all_uses_with(replacement)
        _erase_unused(graph, match.consumer)
    # Per-user nodes the ikbo ops made redundant (a transpose they undo).
    for node in reversed(created):
        if not node._erased and not node.users:
            graph.erase_node(node)
    graph.lint()
    result.recompile()
    return _Applied(result, broadcasts, matches, chosen, reasons)


class _Mismatch(Exception):
    """The rewritten graph's outputs differ from the original's."""


def _relative_error(expected: torch.Tensor, actual: torch.Tensor) -> float:
    expected64, actual64 = expected.detach().double(), actual.detach().double()
    scale = torch.linalg.vector_norm(expected64)
    difference = torch.linalg.vector_norm(actual64 - expected64)
    return float(difference / scale) if scale > 0 else float(difference)


def _compare(expected: Any, actual: Any, tolerance: dict[torch.dtype, float]) -> float:
    """The largest relative error over the outputs; raises _Mismatch past tolerance."""
    expected_leaves, expected_spec = tree_flatten(expected)
    actual_leaves, actual_spec = tree_flatten(actual)
    if expected_spec != actual_spec:
        raise _Mismatch(f"output structure changed: {actual_spec} instead of {expected_spec}")
    worst = 0.0
    for position, (want, got) in enumerate(zip(expected_leaves, actual_leaves)):
        if not isinstance(want, torch.Tensor):
            if want != got:
                raise _Mismatch(f"output {position} is {got!r} instead of {want!r}")
            continue
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
            raise _Mismatch(
                f"output {position} is {type(got).__name__} {getattr(got, 'shape', '')} "
                f"{getattr(got, 'dtype', '')} instead of {want.dtype} {tuple(want.shape)}"
            )
        if not want.is_floating_point():
            if not torch.equal(want, got):
                raise _Mismatch(f"output {position} ({want.dtype}) differs")
            continue
        if not torch.equal(torch.isfinite(want), torch.isfinite(got)):
            raise _Mismatch(f"output {position} has non-finite values where the original has none")
        finite = torch.isfinite(want)
        error = _relative_error(want[finite], got[finite])
        allowed = tolerance.get(want.dtype, DEFAULT_TOLERANCE[torch.float32])
        if not error <= allowed:
            raise _Mismatch(
                f"output {position} differs by relative error {error:.2e} > {allowed:.0e}"
            )
        # The norm alone would pass a few wrong elements among many right
        # ones (a rewrite that feeds a small part of a large output): each
        # element within allowed * (|e| + 8 rms), which rounding never nears.
        want64, got64 = want[finite].double(), got[finite].double()
        rms = want64.square().mean().sqrt() if want64.numel() else 0.0
        outside = (got64 - want64).abs() > allowed * (want64.abs() + 8 * rms)
        if outside.any():
            raise _Mismatch(
                f"output {position} has {int(outside.sum())} elements off by more than "
                f"{allowed:.0e} * (|expected| + 8 rms)"
            )
        worst = max(worst, error)
    return worst


def _copies(values: Any) -> Any:
    return tree_map(
        lambda value: value.clone() if isinstance(value, torch.Tensor) else value, values
    )


class _Runner:
    """Runs graphs of one module on copies of the sample inputs, from the
    module's buffers as they were at the start, and returns the outputs with
    the buffers after the run: a model that writes its inputs or its state in
    place sees the same values in every run, and a result it leaves in a
    buffer is compared too. The caller's inputs and buffers stay as they were."""

    def __init__(self, module: torch.nn.Module, sample_inputs: Sequence[Any]) -> None:
        # torch.compile passes the sizes of a dynamic graph as SymInts; the
        # runs take the request's own sizes, their hints, and guard nothing.
        self.sample_inputs = [
            value.node.hint if isinstance(value, torch.SymInt) else value for value in sample_inputs
        ]
        self.buffers = [(buffer, buffer.clone()) for buffer in module.buffers()]

    def inputs(self) -> list[Any]:
        return _copies(list(self.sample_inputs))

    def restore(self) -> None:
        with torch.no_grad():
            for buffer, saved in self.buffers:
                buffer.copy_(saved)

    def run(self, graph: torch.fx.GraphModule) -> tuple[Any, list[torch.Tensor]]:
        self.restore()
        try:
            with torch.no_grad():
                # Copies: an output may be a buffer, which restore() rewrites.
                outputs = _copies(graph(*self.inputs()))
            return outputs, [buffer.clone() for buffer, _ in self.buffers]
        finally:
            self.restore()


def _verify(applied: _Applied, runner: _Runner, expected: Any, tolerance: dict) -> float:
    try:
        actual = runner.run(applied.module)
    except Exception as error:  # any failure of the rewritten graph disqualifies it
        raise _Mismatch(f"the rewritten graph raised {type(error).__name__}: {error}") from error
    return _compare(expected, actual, tolerance)


class _Tracer(torch.fx.Tracer):
    """symbolic_trace's tracer, but transformer decoder layers are traced
    into, so that their cross-attention is a graph node of its own."""

    def is_leaf_module(self, module: torch.nn.Module, qualified_name: str) -> bool:
        if isinstance(module, _nn.TransformerDecoderLayer):
            return False
        return super().is_leaf_module(module, qualified_name)


def _symbolic_trace(module: torch.nn.Module) -> torch.fx.GraphModule:
    if any(isinstance(item, _nn.TransformerDecoderLayer) for item in module.modules()):
        with contextlib.suppress(Exception):  # a layer it cannot follow: trace it whole
            tracer = _Tracer()
            graph = tracer.trace(module)
            return torch.fx.GraphModule(tracer.root, graph, type(module).__name__)
    return torch.fx.symbolic_trace(module)


def _as_graph_module(
    module: torch.nn.Module | torch.export.ExportedProgram, sample_inputs: Sequence[Any]
) -> tuple[torch.fx.GraphModule, str]:
    if isinstance(module, torch.export.ExportedProgram):
        return module.module(), "torch.export"
    if isinstance(module, torch.fx.GraphModule):
        return module, "fx"
    with contextlib.suppress(Exception):  # symbolic tracing cannot follow: export runs it
        return _symbolic_trace(module), "symbolic_trace"
    # Dim 0 (B or U) of every tensor input left to vary, so that the result
    # takes other requests; a model that export cannot trace so gets the
    # sample's sizes fixed.
    inputs = tuple(sample_inputs)
    rows = tuple(
        {0: torch.export.Dim.AUTO} if isinstance(value, torch.Tensor) and value.dim() else None
        for value in inputs
    )
    try:
        return torch.export.export(module, inputs, dynamic_shapes=rows).module(), "torch.export"
    except Exception:  # noqa: BLE001
        return torch.export.export(module, inputs).module(), "torch.export (static shapes)"


def _left_reason(
    node: Node, broadcast: _Broadcast, reasons: Sequence[str], notes: Sequence[str]
) -> str | None:
    if reasons:
        text = "; ".join(dict.fromkeys(reasons))
    elif broadcast.mapping.kind == "single":
        return None  # an expand is a free view until something above reads it per candidate
    elif node.users and all(_ikbo_operand(user) for user in node.users):
        ops = sorted({str(op.target) for user in node.users for op in _ikbo_operand(user)})
        text = (
            f"kept, at {_shape(node)[0]} rows, as the group-level operand of {', '.join(ops)} "
            "(a multi-level broadcast beside per-group operands is rewritten at their level): "
            "copied to the groups, not to the candidates"
        )
    else:
        users = ", ".join(_describe(user) for user in node.users)
        text = (
            f"used by {users or 'nothing'}, which ikbo does not rewrite (it takes an LCE "
            "bmm/matmul or a linear over a concat with candidate tensors, or the K/V of "
            "SDPA or nn.MultiheadAttention)"
        )
        if any(user.op == "output" for user in node.users):
            text += (
                "; it leaves the graph, so what consumes it runs outside (under torch.compile "
                "this is a graph break, which torch._dynamo.explain names)"
            )
    return "; ".join([text, *(note for note in dict.fromkeys(notes) if note not in text)])


def _ikbo_operand(node: Node) -> list[Node]:
    """The ikbo ops ``node`` feeds directly or through a concat, where it
    feeds nothing else (empty otherwise)."""
    if node.op == "call_function" and str(node.target).startswith("ikbo."):
        return [node]
    if (
        _kind(node) == "cat"
        and node.users
        and all(_ikbo_operand(user) == [user] for user in node.users)
    ):
        return list(node.users)
    return []


def _describe_broadcast(node: Node, broadcast: _Broadcast) -> str:
    if not broadcast.moved:
        return _describe(node)
    return (
        f"{node.name} (the gather of {', '.join(broadcast.origin_names())}, moved below "
        f"{', '.join(broadcast.moved)})"
    )


def _report(
    tracer: str,
    max_error: float,
    applied: _Applied,
    plan: _Plan,
    failures: dict[str, str],
) -> RewriteReport:
    report = RewriteReport(tracer, max_error=max_error)
    if plan.failure:
        report.warnings.append(plan.failure)
    for match in applied.matches:
        report.rewritten.append(
            Rewritten(
                match.consumer.name,
                match.op,
                list(dict.fromkeys(o for item in match.broadcasts for o in item.origin_names())),
                match.broadcasts[0].mapping.describe(),
                match.detail,
                list(dict.fromkeys(m for item in match.broadcasts for m in item.moved)),
            )
        )

    # Rewrites dropped by the check, by the original broadcasts they take.
    planned = {
        match.consumer.name: _Planned(
            _describe(match.consumer),
            match.op,
            frozenset(),
            tuple(dict.fromkeys(o for item in match.broadcasts for o in item.origin_names())),
        )
        for match in applied.candidates
    }
    planned.update(plan.matches)
    dropped: dict[str, list[str]] = {}
    for name, failure in failures.items():
        if name in planned:
            entry = planned[name]
            for origin in entry.origins:
                dropped.setdefault(origin, []).append(
                    f"rewriting {entry.consumer} as {entry.op} was dropped: {failure}"
                )

    survivors = {
        node: broadcast for node, broadcast in applied.broadcasts.items() if not node._erased
    }
    notes = _stop_notes(applied.module, survivors, (), applied.reasons, False)
    names = {node.name for node in survivors}
    for node, broadcast in survivors.items():
        reasons = [message for _, message in applied.reasons.get(node, [])]
        extra = list(notes.get(node, []))
        if not broadcast.moved:
            extra += plan.notes.get(node.name, [])
        for origin in broadcast.origin_names():
            # A dropped rewrite is told at its original broadcast, where that is left.
            if origin in dropped and (not broadcast.moved or origin not in names):
                reasons += dropped[origin]
        reason = _left_reason(node, broadcast, reasons, extra)
        if reason:
            report.left.append(Left(_describe_broadcast(node, broadcast), reason))
    return report


def optimize(
    module: torch.nn.Module | torch.export.ExportedProgram,
    sample_inputs: Sequence[Any],
    *,
    tolerance: dict[torch.dtype, float] | None = None,
    verbose: bool = True,
) -> torch.fx.GraphModule:
    """Rewrites broadcast-then-compute subgraphs of ``module`` into ikbo ops.

    Args:
        module: an ``nn.Module`` (traced with ``torch.fx.symbolic_trace``, into
            ``nn.TransformerDecoderLayer``s too, or with ``torch.export`` where
            symbolic tracing fails), a
            ``torch.fx.GraphModule`` (from either, or from ``torch.compile``),
            or a ``torch.export.ExportedProgram``. Put it in eval mode first.
        sample_inputs: positional inputs of a real request (real tensors, a
            valid mapping): shapes are read from this run, and the rewritten
            graph must reproduce its outputs. The result takes other request
            sizes; where the pass relied on a relation between the sample's
            sizes (user tensors of equal row counts, a reshape to the
            candidate count), a request that breaks it is outside what was
            checked. The torch.compile backend guards such relations instead.
        tolerance: relative Frobenius error allowed per output dtype
            (defaults: :data:`DEFAULT_TOLERANCE`).
        verbose: print the report.

    Returns:
        A ``torch.fx.GraphModule`` sharing ``module``'s parameters, with
        ``ikbo_report`` (a :class:`RewriteReport`) attached. Rewrites that do
        not reproduce the original outputs are not applied, nor are the
        gather moves that only they needed.
    """
    tolerance = {**DEFAULT_TOLERANCE, **(tolerance or {})}
    traced, tracer = _as_graph_module(module, sample_inputs)
    # A copy, so that recording shapes leaves the caller's graph as it was.
    graph_module = torch.fx.GraphModule(traced, copy.deepcopy(traced.graph))
    runner = _Runner(graph_module, sample_inputs)
    with torch.no_grad():
        # ShapeProp may run on fake tensors (inside torch.compile it does), so
        # the reference outputs come from a run of their own. There it must
        # see the sample inputs themselves: copies would become fake tensors
        # of symbolic sizes.
        fake = torch._guards.detect_fake_mode(list(sample_inputs)) is not None
        try:
            ShapeProp(graph_module).propagate(*(sample_inputs if fake else runner.inputs()))
        finally:
            runner.restore()
    expected = runner.run(graph_module)

    plan = _plan(graph_module)
    failures: dict[str, str] = {}
    applied = _rewrite(graph_module, plan, None)
    max_error = 0.0
    if applied.matches:
        try:
            max_error = _verify(applied, runner, expected, tolerance)
        except _Mismatch:
            # Find the culprits one by one and keep the rest.
            passing: set[str] = set()
            for match in applied.matches:
                name = match.consumer.name
                try:
                    single = _rewrite(graph_module, plan, {name})
                    _verify(single, runner, expected, tolerance)
                    passing.add(name)
                except _Mismatch as mismatch:
                    failures[name] = str(mismatch)
            applied = _rewrite(graph_module, plan, passing)
            try:
                max_error = _verify(applied, runner, expected, tolerance)
            except _Mismatch as mismatch:
                for name in passing:
                    failures[name] = f"applied together with the others: {mismatch}"
                applied = _rewrite(graph_module, plan, set())

    report = _report(tracer, max_error, applied, plan, failures)
    result = applied.module
    result.ikbo_report = report
    if verbose:
        print(report)
    return result


def _leave(reason: str) -> None:
    warnings.warn(f"ikbo.rewrite: a graph is left as captured: {reason}", stacklevel=3)


def make_backend(
    compiler: str | Callable[..., Any] = "eager",
    *,
    tolerance: dict[torch.dtype, float] | None = None,
    verbose: bool = True,
    on_report: Callable[[RewriteReport], Any] | None = None,
) -> Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]]:
    """A ``torch.compile`` backend that runs :func:`optimize` on each captured
    graph (checking it on the example inputs torch.compile passes), then hands
    the result to ``compiler``: ``"eager"`` runs it as is; any other name is a
    registered torch.compile backend (``"inductor"``, ``"aot_eager"``, ...), or
    pass a backend callable. ``on_report``, if given, receives the
    :class:`RewriteReport` of each graph (``reports.append`` keeps them all;
    a graph dynamo traces twice, restarting its analysis, reports twice).

    The backend never fails a compile that torch could do without it: a
    graph it cannot check (sizes marked unbacked), a pass that raises, or a
    ``compiler`` that fails on the rewritten graph leave the graph as
    captured, with a warning that says why.

    Graphs traced with dynamic shapes (``dynamic=True``, or torch's automatic
    dynamic shapes from the second request size on) are rewritten too: the
    sizes the rewritten ops need are read at run time, and each decision the
    pass takes on a size guards the compiled graph, so that a request where
    it would go otherwise is compiled, and rewritten, anew."""

    def compile_graph(graph_module: torch.fx.GraphModule, example_inputs: list[Any]):
        optimized = graph_module
        unknown = [
            value
            for value in example_inputs
            if isinstance(value, torch.SymInt) and value.node.hint is None
        ]
        if unknown:
            # Sizes marked unbacked (torch._dynamo.mark_unbacked): no value to
            # check a rewrite on.
            _leave(f"it takes sizes without a value to check a rewrite on ({unknown})")
        else:
            try:
                optimized = optimize(
                    graph_module, example_inputs, tolerance=tolerance, verbose=verbose
                )
            except Exception as error:  # noqa: BLE001 - the model must still compile
                _leave(f"the pass failed: {type(error).__name__}: {error}")
            else:
                if on_report is not None:
                    on_report(optimized.ikbo_report)
        if compiler == "eager":
            return optimized.forward
        inner = torch._dynamo.lookup_backend(compiler) if isinstance(compiler, str) else compiler
        if optimized is not graph_module:
            try:
                return inner(optimized, example_inputs)
            except torch._dynamo.exc.RestartAnalysis:
                raise  # dynamo's request to trace the frame again, not a failure
            except Exception as error:  # noqa: BLE001
                _leave(f"{compiler} failed on the rewritten graph: {type(error).__name__}: {error}")
        return inner(graph_module, example_inputs)

    return compile_graph


backend = make_backend()
"""``torch.compile(model, backend=ikbo.rewrite.backend)``: rewrite, verify, run eagerly."""
