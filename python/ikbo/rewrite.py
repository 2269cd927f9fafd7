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
  back, and transposes that cancel are dropped.

Every rewrite is checked: the rewritten graph runs on the sample inputs and
its outputs must match the original's (relative Frobenius error per output
within a dtype tolerance). A rewrite that fails alone is dropped. The pass
prints a report of what it rewrote, and which broadcasts it left and why.

Entry points: :func:`optimize` (a module or exported program plus sample
inputs) and :func:`backend` / :func:`make_backend` for ``torch.compile``.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata
from torch.utils._pytree import tree_flatten

from . import torch_ops  # noqa: F401 -- registers the torch.ops.ikbo operators

__all__ = ["RewriteReport", "backend", "make_backend", "optimize"]

Node = torch.fx.Node

# Relative Frobenius error allowed between the original and the rewritten
# graph, per output dtype: both sides round once to the output dtype but sum
# in different orders, so this is about twice each side's own error.
DEFAULT_TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float32: 1e-4}

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ATTENTION_HEAD_DIMS = (64, 128)

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


def _normalize_dim(dim: Any, ndim: int) -> int | None:
    if not isinstance(dim, int) or not -ndim <= dim < ndim:
        return None
    return dim % ndim


def _describe(node: Any) -> str:
    """How a node reads in the report: its name and what it calls."""
    if not isinstance(node, Node):
        return repr(node)
    if node.op in ("placeholder", "get_attr"):
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

    kind "index": ``source`` is the index node; "counts": ``source`` is the
    per-user counts node; "uniform": every one of ``num_users`` users has
    ``source`` consecutive candidates (an int, or a node computing one);
    "single": one user, ``source`` is the number of candidates.
    """

    kind: str
    source: Any
    num_users: int = 0

    def describe(self) -> str:
        source = self.source.name if isinstance(self.source, Node) else self.source
        if self.kind == "index":
            return f"cand_to_user = {source}"
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
        return _Broadcast(node, unit, _Mapping("uniform", repeats, num_users), unit_dim=1)

    if len(source_shape) != len(shape):
        return None
    index = _row_index(call)
    if index is not None:
        return _Broadcast(node, source, _Mapping("index", index))
    if call.kind == "repeat_interleave":
        if _normalize_dim(call.get("dim"), len(shape)) != 0:
            return None
        repeats = call.get("repeats")
        if _integer_vector(repeats):
            return _Broadcast(node, source, _Mapping("counts", repeats))
        if isinstance(repeats, int) or (
            isinstance(repeats, Node) and repeats.meta.get("type") is int
        ):
            return _Broadcast(node, source, _Mapping("uniform", repeats, source_shape[0]))
        return None
    if call.kind == "expand" and source_shape[0] == 1 and source_shape[1:] == shape[1:]:
        return _Broadcast(node, source, _Mapping("single", shape[0]))
    return None


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
            elif mapping.kind == "counts":
                node = self.insert(torch.repeat_interleave, mapping.source)
            elif mapping.kind == "uniform":
                node = self.insert(_uniform_user_index, user, mapping.source)
            else:
                node = self.insert(_single_user_index, broadcast.node)
            self.indices[mapping] = node
        return self.indices[mapping]

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
    if len({item.mapping for item in block}) != 1:
        raise _Skip(f"the operands of {concat.name} are broadcast by different mappings", involved)
    if len({_shape(item.user)[0] for item in block}) != 1:
        raise _Skip(f"the user operands of {concat.name} have different user counts", involved)
    candidates = [operand for operand, item in zip(operands, found) if item is None]
    user_width = sum(_shape(item.node)[feature_dim] for item in block)
    candidate_width = sum(_shape(node)[feature_dim] for node in candidates)
    return _ConcatSplit(list(block), candidates, user_first, user_width, candidate_width)


def _column_blocks(context: _Context, weight: Node, split: _ConcatSplit) -> tuple[Node, Node]:
    """Views (w_c, w_u) of a weight whose columns follow the concat's order."""
    user_start = 0 if split.user_first else split.candidate_width
    candidate_start = split.user_width if split.user_first else 0
    w_u = context.insert(torch.narrow, weight, 1, user_start, split.user_width)
    w_c = context.insert(torch.narrow, weight, 1, candidate_start, split.candidate_width)
    return w_c, w_u


def _is_one_matrix(shape: tuple[int, ...] | None) -> bool:
    return shape is not None and (len(shape) == 2 or (len(shape) == 3 and shape[0] == 1))


def _shared_weight(node: Node, split: _ConcatSplit) -> Node:
    """The [M, K] (or [1, M, K]) matrix a matmul operand applies to every candidate."""
    shape = _shape(node) or ()
    if _is_one_matrix(shape):
        return node
    if _kind(node) == "expand":
        source = _recognize(node).get("input")
        if _is_one_matrix(_shape(source)):
            return source
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
    weight = _shared_weight(weight_operand, split)
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
        w_c, w_u = _column_blocks(context, matrix, split)
        users = [context.user(item) for item in split.broadcasts]
        index = context.index(split.broadcasts[0], users[0])
        e_u = context.concat(users, 1)
        e_c = context.concat(split.candidates, 1)
        return context.insert(torch.ops.ikbo.lce.default, w_c, w_u, e_c, e_u, index)

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
        w_c, w_u = _column_blocks(context, operands.node(context, operands.weight), split)
        users = [context.user(item) for item in split.broadcasts]
        index = context.index(split.broadcasts[0], users[0])
        x_u = context.concat(users, 1)
        x_c = context.concat(split.candidates, 1)
        bias = operands.node(context, operands.bias)
        return context.insert(torch.ops.ikbo.linear.default, w_c, w_u, x_c, x_u, index, bias)

    weight_name = operands.weight if isinstance(operands.weight, str) else operands.weight.name
    detail = (
        f"weight {weight_name} split into Ku={split.user_width} user / "
        f"Kc={split.candidate_width} candidate columns"
    )
    return _Match(node, "ikbo::linear", split.broadcasts, detail, build)


def _swaps_heads_and_tokens(node: Any) -> Node | None:
    """The input of ``node`` when ``node`` only swaps dims 1 and 2 of a 4-D tensor."""
    call = _recognize(node) if isinstance(node, Node) else None
    shape = _shape(node)
    if call is None or shape is None or len(shape) != 4:
        return None
    if call.kind == "transpose":
        dims = {_normalize_dim(call.get("dim0"), 4), _normalize_dim(call.get("dim1"), 4)}
        return call.get("input") if dims == {1, 2} else None
    if call.kind == "permute":
        dims = tuple(_normalize_dim(dim, 4) for dim in call.get("dims") or ())
        return call.get("input") if dims == (0, 2, 1, 3) else None
    return None


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
        return broadcasts[node], False
    inner = _swaps_heads_and_tokens(node)
    if inner is not None and inner in broadcasts:
        return broadcasts[inner], True
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
        raise skip(f"head dim D={query_shape[3]}; ikbo attention takes D in {{64, 128}}")
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
        )
        return context.insert(torch.transpose, out, 1, 2)

    detail = f"H={query_shape[1]}, D={query_shape[3]}, S={key_shape[2]}"
    return _Match(node, "ikbo::attention", [key[0], value[0]], detail, build)


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
            lines.append(
                f"  rewrote {item.node} -> {item.op}: broadcast {', '.join(item.broadcasts)} "
                f"({item.mapping}); {item.detail}"
            )
        for item in self.left:
            lines.append(f"  left {item.node}: {item.reason}")
        return "\n".join(lines)


def _find_matches(
    module: torch.fx.GraphModule,
) -> tuple[dict[Node, _Broadcast], list[_Match], dict[Node, list[str]]]:
    """Every broadcast, the consumers that can be rewritten, and for each
    broadcast the reasons its other consumers cannot."""
    broadcasts: dict[Node, _Broadcast] = {}
    for node in module.graph.nodes:
        found = _find_broadcast(node)
        if found is not None:
            broadcasts[node] = found
    matchers = (
        lambda node: _match_lce(node, broadcasts),
        lambda node: _match_linear(node, broadcasts, module),
        lambda node: _match_attention(node, broadcasts),
    )
    matches: list[_Match] = []
    reasons: dict[Node, list[str]] = {}
    for node in module.graph.nodes:
        for matcher in matchers:
            try:
                match = matcher(node)
            except _Skip as skip:
                for item in skip.broadcasts:
                    reasons.setdefault(item.node, []).append(f"{_describe(node)}: {skip}")
                break
            if match is not None:
                matches.append(match)
                break
    return broadcasts, matches, reasons


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
    reasons: dict[Node, list[str]]


def _rewrite(module: torch.fx.GraphModule, selected: set[str] | None) -> _Applied:
    """A copy of ``module`` (sharing its parameters) with the matches whose
    consumer is named in ``selected`` (all when None) replaced by ikbo ops.
    Node names survive the copy, so matches found on the original name the
    same consumers here."""
    result = torch.fx.GraphModule(module, copy.deepcopy(module.graph))
    broadcasts, matches, reasons = _find_matches(result)
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
        worst = max(worst, error)
    return worst


def _verify(
    applied: _Applied, sample_inputs: Sequence[Any], expected: Any, tolerance: dict
) -> float:
    try:
        with torch.no_grad():
            actual = applied.module(*sample_inputs)
    except Exception as error:  # any failure of the rewritten graph disqualifies it
        raise _Mismatch(f"the rewritten graph raised {type(error).__name__}: {error}") from error
    return _compare(expected, actual, tolerance)


def _as_graph_module(
    module: torch.nn.Module | torch.export.ExportedProgram, sample_inputs: Sequence[Any]
) -> tuple[torch.fx.GraphModule, str]:
    if isinstance(module, torch.export.ExportedProgram):
        return module.module(), "torch.export"
    if isinstance(module, torch.fx.GraphModule):
        return module, "fx"
    try:
        return torch.fx.symbolic_trace(module), "symbolic_trace"
    except Exception:  # noqa: BLE001 -- Python symbolic tracing cannot follow: export runs it
        return torch.export.export(module, tuple(sample_inputs)).module(), "torch.export"


def _left_reason(node: Node, broadcast: _Broadcast, reasons: list[str] | None) -> str | None:
    if reasons:
        return "; ".join(dict.fromkeys(reasons))
    if broadcast.mapping.kind == "single":
        return None  # an expand is a free view until something above reads it per candidate
    users = ", ".join(_describe(user) for user in node.users)
    return (
        f"used by {users or 'nothing'}, which ikbo does not rewrite (it takes an LCE bmm/matmul "
        "or a linear over a concat with candidate tensors, or SDPA K/V)"
    )


def optimize(
    module: torch.nn.Module | torch.export.ExportedProgram,
    sample_inputs: Sequence[Any],
    *,
    tolerance: dict[torch.dtype, float] | None = None,
    verbose: bool = True,
) -> torch.fx.GraphModule:
    """Rewrites broadcast-then-compute subgraphs of ``module`` into ikbo ops.

    Args:
        module: an ``nn.Module`` (traced with ``torch.fx.symbolic_trace``, or
            ``torch.export`` where symbolic tracing fails), a
            ``torch.fx.GraphModule`` (from either, or from ``torch.compile``),
            or a ``torch.export.ExportedProgram``. Put it in eval mode first.
        sample_inputs: positional inputs of a real request (real tensors, a
            valid mapping): shapes are read from this run, and the rewritten
            graph must reproduce its outputs.
        tolerance: relative Frobenius error allowed per output dtype
            (defaults: :data:`DEFAULT_TOLERANCE`).
        verbose: print the report.

    Returns:
        A ``torch.fx.GraphModule`` sharing ``module``'s parameters, with
        ``ikbo_report`` (a :class:`RewriteReport`) attached. Rewrites that do
        not reproduce the original outputs are not applied.
    """
    tolerance = {**DEFAULT_TOLERANCE, **(tolerance or {})}
    traced, tracer = _as_graph_module(module, sample_inputs)
    # A copy, so that recording shapes leaves the caller's graph as it was.
    graph_module = torch.fx.GraphModule(traced, copy.deepcopy(traced.graph))
    with torch.no_grad():
        # ShapeProp may run on fake tensors (inside torch.compile it does), so
        # the reference outputs come from a run of their own.
        ShapeProp(graph_module).propagate(*sample_inputs)
        expected = graph_module(*sample_inputs)

    failures: dict[str, str] = {}
    applied = _rewrite(graph_module, None)
    max_error = 0.0
    if applied.matches:
        try:
            max_error = _verify(applied, sample_inputs, expected, tolerance)
        except _Mismatch:
            # Find the culprits one by one and keep the rest.
            passing: set[str] = set()
            for match in applied.matches:
                name = match.consumer.name
                try:
                    _verify(_rewrite(graph_module, {name}), sample_inputs, expected, tolerance)
                    passing.add(name)
                except _Mismatch as mismatch:
                    failures[name] = str(mismatch)
            applied = _rewrite(graph_module, passing)
            try:
                max_error = _verify(applied, sample_inputs, expected, tolerance)
            except _Mismatch as mismatch:
                for name in passing:
                    failures[name] = f"applied together with the others: {mismatch}"
                applied = _rewrite(graph_module, set())

    report = RewriteReport(tracer, max_error=max_error)
    for match in applied.matches:
        report.rewritten.append(
            Rewritten(
                match.consumer.name,
                match.op,
                list(dict.fromkeys(item.node.name for item in match.broadcasts)),
                match.broadcasts[0].mapping.describe(),
                match.detail,
            )
        )
    reasons = {node.name: list(found) for node, found in applied.reasons.items()}
    for match in applied.candidates:
        if match.consumer.name in failures:
            for item in match.broadcasts:
                reasons.setdefault(item.node.name, []).append(
                    f"rewriting {_describe(match.consumer)} as {match.op} was dropped: "
                    f"{failures[match.consumer.name]}"
                )
    remaining = {node.name: node for node in applied.module.graph.nodes}
    for node, broadcast in applied.broadcasts.items():
        survivor = remaining.get(node.name)
        reason = survivor and _left_reason(survivor, broadcast, reasons.get(node.name))
        if reason:
            report.left.append(Left(_describe(survivor), reason))

    result = applied.module
    result.ikbo_report = report
    if verbose:
        print(report)
    return result


def make_backend(
    compiler: str | Callable[..., Any] = "eager",
    *,
    tolerance: dict[torch.dtype, float] | None = None,
    verbose: bool = True,
) -> Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]]:
    """A ``torch.compile`` backend that runs :func:`optimize` on each captured
    graph (checking it on the example inputs torch.compile passes), then hands
    the result to ``compiler``: ``"eager"`` runs it as is; any other name is a
    registered torch.compile backend (``"inductor"``, ``"aot_eager"``, ...), or
    pass a backend callable."""

    def compile_graph(graph_module: torch.fx.GraphModule, example_inputs: list[Any]):
        optimized = optimize(graph_module, example_inputs, tolerance=tolerance, verbose=verbose)
        if compiler == "eager":
            return optimized.forward
        inner = torch._dynamo.lookup_backend(compiler) if isinstance(compiler, str) else compiler
        return inner(optimized, example_inputs)

    return compile_graph


backend = make_backend()
"""``torch.compile(model, backend=ikbo.rewrite.backend)``: rewrite, verify, run eagerly."""
