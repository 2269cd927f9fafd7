"""torch.ops.ikbo.{lce, attention, linear}: results against float64 references,
the operator contract (torch.library.opcheck), the library's errors, the
per-request candidate map cache, torch.compile / torch.export tracing, and on
a GPU, CUDA graph capture."""

import gc
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import ikbo
from reference import assert_close, attention_reference, jagged_offsets, lce_reference

torch = pytest.importorskip(
    "torch", reason="torch is not importable; the torch.library op tests need it"
)
from ikbo import torch_ops  # after torch's check; a failing import must fail

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
CUDA = torch.cuda.is_available() and ikbo.built_with_cuda() and ikbo.cuda_device_count() > 0
needs_cuda = pytest.mark.skipif(
    not CUDA,
    reason=f"no CUDA device (torch.cuda.is_available() = {torch.cuda.is_available()}, "
    f"ikbo.built_with_cuda() = {ikbo.built_with_cuda()})",
)


def randn(generator, shape, dtype=torch.float32, device="cpu"):
    return torch.randn(shape, generator=generator, dtype=torch.float32).to(device, dtype)


def linear_reference(w_c, w_u, x_c, x_u, cand_to_user, bias=None):
    mapping = cand_to_user.long().cpu()
    out = (
        x_c.double().cpu() @ w_c.double().cpu().T
        + x_u.double().cpu()[mapping] @ w_u.double().cpu().T
    )
    return (out if bias is None else out + bias.double().cpu()).numpy()


def lce_inputs(generator, dtype=torch.float32, device="cpu"):
    m, ku, kc, n = 11, 6, 9, 5
    return (
        randn(generator, (m, kc), dtype, device) / kc**0.5,
        randn(generator, (m, ku), dtype, device) / ku**0.5,
        randn(generator, (7, kc, n), dtype, device),
        randn(generator, (3, ku, n), dtype, device),
        torch.tensor([2, 0, 0, 2, 1, 2, 0], dtype=torch.int32, device=device),
    )


@pytest.mark.parametrize("dtype_name", TORCH_DTYPES)
def test_lce(dtype_name):
    w_c, w_u, e_c, e_u, cand_to_user = lce_inputs(
        torch.Generator().manual_seed(1), TORCH_DTYPES[dtype_name]
    )
    out = torch.ops.ikbo.lce(w_c, w_u, e_c, e_u, cand_to_user)
    assert out.dtype == e_c.dtype and out.shape == (7, 11, 5)
    assert_close(out, lce_reference(w_c, w_u, e_c, e_u, cand_to_user), dtype_name)


def test_lce_takes_int64_mappings_and_strided_inputs():
    w_c, w_u, e_c, e_u, cand_to_user = lce_inputs(torch.Generator().manual_seed(2))
    e_c_strided = e_c.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    out = torch.ops.ikbo.lce(w_c, w_u, e_c_strided, e_u, cand_to_user.long())
    assert_close(out, lce_reference(w_c, w_u, e_c, e_u, cand_to_user), "float32")


def test_a_negated_view_of_the_mapping_reads_as_its_values():
    """DLPack carries no negation bit: a torch negative view must reach the
    library as the values it stands for, not as the memory under it."""
    w_c, w_u, e_c, e_u, cand_to_user = lce_inputs(torch.Generator().manual_seed(2))
    negated = torch._neg_view(-cand_to_user)
    assert negated.is_neg() and torch.equal(negated, cand_to_user)
    out = torch.ops.ikbo.lce(w_c, w_u, e_c, e_u, negated)
    assert_close(out, lce_reference(w_c, w_u, e_c, e_u, cand_to_user), "float32")
    assert list(torch_ops.candidate_map(negated, 3).cand_to_user) == cand_to_user.tolist()


@pytest.mark.parametrize("dtype_name", TORCH_DTYPES)
def test_attention_dense_and_jagged(dtype_name):
    dtype = TORCH_DTYPES[dtype_name]
    generator = torch.Generator().manual_seed(3)
    q = randn(generator, (5, 3, 2, 64), dtype)
    cand_to_user = torch.tensor([1, 0, 2, 2, 1], dtype=torch.int32)
    k, v = randn(generator, (3, 10, 2, 64), dtype), randn(generator, (3, 10, 2, 64), dtype)
    out = torch.ops.ikbo.attention(q, k, v, cand_to_user)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, attention_reference(q, k, v, cand_to_user), dtype_name)

    offsets = jagged_offsets((4, 0, 9))  # user 1 has no history: zeros
    k_jagged, v_jagged = randn(generator, (13, 2, 64), dtype), randn(generator, (13, 2, 64), dtype)
    out = torch.ops.ikbo.attention(
        q, k_jagged, v_jagged, cand_to_user, torch.from_numpy(offsets), scale=0.3
    )
    expected = attention_reference(q, k_jagged, v_jagged, cand_to_user, offsets, scale=0.3)
    assert_close(out, expected, dtype_name)


@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_on_column_blocks_of_one_weight(with_bias):
    generator = torch.Generator().manual_seed(4)
    weight = randn(generator, (6, 4 + 7))
    bias = randn(generator, (6,)) if with_bias else None
    x_c, x_u = randn(generator, (5, 7)), randn(generator, (2, 4))
    cand_to_user = torch.tensor([1, 1, 0, 1, 0])
    out = torch.ops.ikbo.linear(weight[:, 4:], weight[:, :4], x_c, x_u, cand_to_user, bias)
    expected = torch.nn.functional.linear(torch.cat([x_u[cand_to_user], x_c], -1), weight, bias)
    assert_close(out, expected.double().numpy(), "float32")
    assert_close(
        out, linear_reference(weight[:, 4:], weight[:, :4], x_c, x_u, cand_to_user, bias), "float32"
    )


def test_operator_contract():
    generator = torch.Generator().manual_seed(5)
    cand_to_user = torch.tensor([0, 1, 1, 0], dtype=torch.int32)
    torch.library.opcheck(
        torch.ops.ikbo.lce.default,
        (
            randn(generator, (5, 3)),
            randn(generator, (5, 2)),
            randn(generator, (4, 3, 6)),
            randn(generator, (2, 2, 6)),
            cand_to_user,
        ),
    )
    torch.library.opcheck(
        torch.ops.ikbo.attention.default,
        (
            randn(generator, (4, 3, 2, 64)),
            randn(generator, (7, 2, 64)),
            randn(generator, (7, 2, 64)),
            cand_to_user,
            torch.tensor([0, 3, 7], dtype=torch.int32),
            0.5,
        ),
    )
    torch.library.opcheck(
        torch.ops.ikbo.linear.default,
        (
            randn(generator, (5, 3)),
            randn(generator, (5, 2)),
            randn(generator, (4, 3)),
            randn(generator, (2, 2)),
            cand_to_user,
            randn(generator, (5,)),
        ),
    )
    # Through a level of 3 groups (cand_to_user's values) to 2 users.
    torch.library.opcheck(
        torch.ops.ikbo.attention.default,
        (
            randn(generator, (4, 3, 2, 64)),
            randn(generator, (2, 5, 2, 64)),
            randn(generator, (2, 5, 2, 64)),
            cand_to_user,
            None,
            None,
            [torch.tensor([1, 0, 1])],
        ),
    )


def test_library_errors_reach_the_caller():
    w_c, w_u, e_c, e_u, cand_to_user = lce_inputs(torch.Generator().manual_seed(6))
    with pytest.raises(ValueError, match="e_u"):
        torch.ops.ikbo.lce(w_c, w_u, e_c, e_u[:, :5], cand_to_user)
    with pytest.raises(ValueError, match="cand_to_user"):
        torch.ops.ikbo.lce(w_c, w_u, e_c, e_u, torch.tensor([0, 1, 2, 3, 0, 0, 0]))
    # 2**32 must not wrap to the valid index 0 when narrowed to int32, and
    # on the CPU the message gives the value itself.
    with pytest.raises(ValueError, match=re.escape("cand_to_user[0] = 4294967296 is outside")):
        torch.ops.ikbo.lce(w_c, w_u, e_c, e_u, torch.tensor([2**32, 0, 0, 0, 0, 0, 0]))
    q, k = torch.zeros(7, 1, 1, 64), torch.zeros(4, 1, 64)
    with pytest.raises(ValueError, match=re.escape("kv_offsets[3] = -8589934592 is outside")):
        torch.ops.ikbo.attention(q, k, k, cand_to_user, torch.tensor([0, 1, 2, -(2**33)]))
    with pytest.raises(ValueError, match="w_c is a meta tensor, which holds no values"):
        ikbo.lce(w_c.to("meta"), w_u, e_c, e_u, cand_to_user)
    with pytest.raises(ValueError, match=re.escape("float64")):
        torch.ops.ikbo.lce(w_c.double(), w_u, e_c, e_u, cand_to_user)


def test_argument_errors_name_the_argument():
    w_c, w_u, e_c, e_u, cand_to_user = lce_inputs(torch.Generator().manual_seed(20))
    with pytest.raises(TypeError, match="w_c must be a torch.Tensor, got NoneType"):
        torch.ops.ikbo.lce(None, w_u, e_c, e_u, cand_to_user)
    with pytest.raises(ValueError, match="cand_to_user must have dtype int32 or int64, got int16"):
        torch.ops.ikbo.lce(w_c, w_u, e_c, e_u, cand_to_user.short())
    with pytest.raises(ValueError, match="kv_offsets must have dtype int32 or int64, got float32"):
        q, k = torch.zeros(7, 1, 1, 64), torch.zeros(4, 1, 64)
        torch.ops.ikbo.attention(q, k, k, cand_to_user, torch.tensor([0.0, 1, 2, 4]))


def test_shapes_layouts_and_views_the_ops_check_first():
    """A 0-d user tensor gets its rank error (U is read from it); a sparse
    tensor is refused by name; an invalid non-contiguous view is refused
    before it is copied (here the copy would take 24 TiB); ikbo.lce on a
    torch negative view reads its values negated, and refuses one as out."""
    w_c, w_u, e_c, e_u, cand_to_user = lce_inputs(torch.Generator().manual_seed(21))
    scalar = torch.tensor(1.0)
    with pytest.raises(ValueError, match=re.escape("e_u must have 3 dimensions, got 0")):
        torch.ops.ikbo.lce(w_c, w_u, e_c, scalar, cand_to_user)
    x_c, x_u = torch.ones(7, 2), torch.ones(3, 4)
    with pytest.raises(ValueError, match=re.escape("x_u must have 2 dimensions, got 0")):
        torch.ops.ikbo.linear(torch.ones(5, 2), torch.ones(5, 4), x_c, scalar, cand_to_user)
    q = torch.zeros(7, 1, 1, 64)
    for kv_offsets, rank in ((None, 4), (torch.tensor([0, 1, 2, 4]), 3)):
        with pytest.raises(ValueError, match=re.escape(f"k must have {rank} dimensions, got 0")):
            torch.ops.ikbo.attention(q, scalar, scalar, cand_to_user, kv_offsets)
    with pytest.raises(ValueError, match="e_c must be a dense .strided. tensor, got layout"):
        torch.ops.ikbo.lce(w_c, w_u, e_c.to_sparse(), e_u, cand_to_user)
    with pytest.raises(ValueError, match="bias must be a dense .strided. tensor, got layout"):
        torch.ops.ikbo.linear(
            torch.ones(5, 2), torch.ones(5, 4), x_c, x_u, cand_to_user, torch.ones(5).to_sparse()
        )
    # Valid calls first, so that the plans are cached and not what checks.
    weights = torch.ones(5, 2), torch.ones(5, 4)
    torch.ops.ikbo.lce(w_c, w_u, e_c, e_u, cand_to_user)
    torch.ops.ikbo.linear(*weights, x_c, x_u, cand_to_user)
    huge = torch.ones(1, 6, 1).expand(2**20, 6, 2**20)  # Kc is 9
    with pytest.raises(ValueError, match=re.escape("e_c dimension 1 must be 9")):
        torch.ops.ikbo.lce(w_c, w_u, huge, e_u, cand_to_user)
    rows = torch.ones(1, 2).expand(2**40, 2)
    with pytest.raises(ValueError, match=re.escape("x_c dimension 0 must be 7")):
        torch.ops.ikbo.linear(*weights, rows, x_u, cand_to_user)
    # torch._neg_view is private; DLPack carries no negation flag.
    expected = torch.ops.ikbo.lce(w_c, w_u, -e_c, e_u, cand_to_user)
    got = ikbo.lce(w_c, w_u, torch._neg_view(e_c), e_u, cand_to_user)
    torch.testing.assert_close(got, expected)
    from_negated_weight = ikbo.lce(torch._neg_view(-w_c), w_u, -e_c, e_u, cand_to_user)
    torch.testing.assert_close(from_negated_weight, expected)
    with pytest.raises(ValueError, match="out must hold its values, got a torch negative view"):
        ikbo.lce(w_c, w_u, e_c, e_u, cand_to_user, out=torch._neg_view(torch.empty_like(got)))


def test_requests_without_users():
    """U = 0 is a valid request when B = 0 too (an empty output); with
    candidates, the error names the tensor that has no users."""
    generator = torch.Generator().manual_seed(21)
    w_c, w_u, e_c, e_u, cand_to_user = lce_inputs(generator)
    none = cand_to_user[:0]
    out = torch.ops.ikbo.lce(w_c, w_u, e_c[:0], e_u[:0], none)
    assert out.shape == (0, 11, 5) and out.dtype == e_c.dtype
    with pytest.raises(ValueError, match=re.escape("e_u dimension 0 (U) must be >= 1")):
        torch.ops.ikbo.lce(w_c, w_u, e_c, e_u[:0], cand_to_user)

    q, k = randn(generator, (7, 3, 2, 64)), randn(generator, (0, 4, 2, 64))
    assert torch.ops.ikbo.attention(q[:0], k, k, none).shape == (0, 3, 2, 64)
    with pytest.raises(ValueError, match=re.escape("k dimension 0 (U) must be >= 1")):
        torch.ops.ikbo.attention(q, k, k, cand_to_user)
    k, offsets = k.flatten(0, 1), torch.zeros(1, dtype=torch.int32)  # jagged, kv_offsets [0]
    assert torch.ops.ikbo.attention(q[:0], k, k, none, offsets).shape == (0, 3, 2, 64)
    with pytest.raises(ValueError, match=re.escape("kv_offsets dimension 0 (U + 1) must be >= 2")):
        torch.ops.ikbo.attention(q, k, k, cand_to_user, offsets)

    weight, x_c, x_u = randn(generator, (6, 9)), randn(generator, (7, 5)), randn(generator, (0, 4))
    assert torch.ops.ikbo.linear(weight[:, 4:], weight[:, :4], x_c[:0], x_u, none).shape == (0, 6)
    with pytest.raises(ValueError, match=re.escape("x_u dimension 0 (U) must be >= 1")):
        torch.ops.ikbo.linear(weight[:, 4:], weight[:, :4], x_c, x_u, cand_to_user)


def invalid_calls():
    """(op, arguments, the message both the op and its fake implementation raise)."""
    r = torch.randn
    mapping = torch.tensor([0, 1, 1, 0], dtype=torch.int32)
    lce, attention, linear = torch.ops.ikbo.lce, torch.ops.ikbo.attention, torch.ops.ikbo.linear
    return {
        "lce Kc": (
            lce,
            (r(5, 3), r(5, 2), r(4, 4, 6), r(2, 2, 6), mapping),
            "e_c dimension 1 must be 3",
        ),
        "lce dtypes": (
            lce,
            (r(5, 3), r(5, 2), r(4, 3, 6).bfloat16(), r(2, 2, 6), mapping),
            "e_c must have dtype float32, got bfloat16",
        ),
        "lce B": (
            lce,
            (r(5, 3), r(5, 2), r(4, 3, 6), r(2, 2, 6), mapping[:3]),
            "e_c dimension 0 must be 3",
        ),
        "lce U = 0": (
            lce,
            (r(5, 3), r(5, 2), r(4, 3, 6), r(0, 2, 6), mapping),
            r"e_u dimension 0 \(U\)",
        ),
        "attention D": (
            attention,
            (r(4, 3, 2, 32), r(2, 5, 2, 32), r(2, 5, 2, 32), mapping),
            r"q dimension 3 \(head dim D\) must be 64, 128 or 256, got 32",
        ),
        "attention Dv": (
            attention,
            (r(4, 3, 2, 64), r(2, 5, 2, 64), r(2, 5, 2, 128), mapping),
            re.escape("v must have shape [2, 5, 2, 64] (the shape of k), got [2, 5, 2, 128]"),
        ),
        "linear x_c": (
            linear,
            (r(5, 3), r(5, 2), r(4, 7, 3), r(2, 2), mapping),
            re.escape("x_c must have 2 dimensions, got 3 (shape [4, 7, 3])"),
        ),
        "linear bias": (
            linear,
            (r(5, 3), r(5, 2), r(4, 3), r(2, 2), mapping, r(4, 5)),
            "bias must have 1 dimensions, got 2",
        ),
    }


@pytest.mark.parametrize("case", invalid_calls())
def test_fake_implementations_refuse_what_the_ops_refuse(case):
    """Tracing (torch.compile, torch.export) must fail where running fails,
    rather than give an output shape for an invalid call."""
    op, arguments, message = invalid_calls()[case]
    with pytest.raises(ValueError, match=message):
        op(*arguments)
    with (
        torch._subclasses.fake_tensor.FakeTensorMode() as mode,
        pytest.raises(ValueError, match=message),
    ):
        op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in arguments))


def test_backward_is_refused():
    """An input that requires grad is accepted, with the same result; backward
    through the output raises, naming the op. The optional arguments (None, a
    scale, a list of levels) cross the autograd layer as they came."""
    generator = torch.Generator().manual_seed(7)
    w_c, w_u, e_c, e_u, cand_to_user = lce_inputs(generator)
    q = randn(generator, (4, 3, 2, 64))
    k, v = randn(generator, (2, 5, 2, 64)), randn(generator, (2, 5, 2, 64))
    to_group, group_to_user = torch.tensor([0, 2, 1, 2]), torch.tensor([1, 0, 1])
    cases = {  # each op, as a function of the input that will require grad
        "lce": (w_c, lambda w: torch.ops.ikbo.lce(w, w_u, e_c, e_u, cand_to_user)),
        "linear": (
            w_c,
            lambda w: torch.ops.ikbo.linear(w, w_u, e_c[..., 0], e_u[..., 0], cand_to_user),
        ),
        "attention": (
            q,
            lambda q: torch.ops.ikbo.attention(q, k, v, to_group, None, 0.25, [group_to_user]),
        ),
    }
    for name, (tensor, call) in cases.items():
        expected = call(tensor)
        out = call(tensor.detach().requires_grad_())
        assert out.requires_grad and not expected.requires_grad
        torch.testing.assert_close(out.detach(), expected, rtol=0, atol=0)
        with pytest.raises(RuntimeError, match=f"ikbo::{name} is inference-only"):
            out.sum().backward()


def counting(kind):
    return torch_ops.build_counts().get(kind, 0)


def test_map_is_built_once_per_request_and_weights_once():
    generator = torch.Generator().manual_seed(8)
    w_c, w_u, e_c, e_u, _ = lce_inputs(generator)
    q, k = randn(generator, (7, 2, 1, 64)), randn(generator, (3, 4, 1, 64))
    maps, plans = counting("CandidateMap"), counting("LcePlan")
    for request in range(2):
        cand_to_user = torch.tensor([request, 0, 1, 2, 2, 1, 0])  # a new tensor per request
        torch.ops.ikbo.lce(w_c, w_u, e_c, e_u, cand_to_user)
        torch.ops.ikbo.lce(w_c, w_u, e_c, e_u, cand_to_user[:])  # a view of it: same map
        torch.ops.ikbo.attention(q, k, k, cand_to_user)
        assert counting("CandidateMap") == maps + request + 1
    assert counting("LcePlan") == plans + 1


def test_levels_compose_the_map_once_for_every_op():
    """Candidates -> vendors -> users: each op with levels=[vendor_to_user]
    equals the op on the composed index, and the three share one map."""
    generator = torch.Generator().manual_seed(31)
    vendor_to_user = torch.tensor([2, 0, 2, 1, 0])  # 3 users
    cand_to_vendor = torch.tensor([4, 0, 0, 3, 1, 4, 2])  # vendor ids; 7 candidates
    composed = vendor_to_user[cand_to_vendor]
    w_c, w_u, e_c, _, _ = lce_inputs(generator)
    e_u = randn(generator, (3, w_u.shape[1], e_c.shape[2]))
    q, k = randn(generator, (7, 2, 1, 64)), randn(generator, (3, 4, 1, 64))
    x_c, x_u = randn(generator, (7, 3)), randn(generator, (3, 2))
    lw_c, lw_u = randn(generator, (5, 3)), randn(generator, (5, 2))
    maps = counting("CandidateMap")
    levels = [vendor_to_user]
    results = (
        torch.ops.ikbo.lce(w_c, w_u, e_c, e_u, cand_to_vendor, levels),
        torch.ops.ikbo.attention(q, k, k, cand_to_vendor, levels=levels),
        torch.ops.ikbo.linear(lw_c, lw_u, x_c, x_u, cand_to_vendor, levels=levels),
    )
    assert counting("CandidateMap") == maps + 1
    expected = (
        torch.ops.ikbo.lce(w_c, w_u, e_c, e_u, composed),
        torch.ops.ikbo.attention(q, k, k, composed),
        torch.ops.ikbo.linear(lw_c, lw_u, x_c, x_u, composed),
    )
    for got, want in zip(results, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # Three levels: the ids of requests' users (users -> 2 requests).
    user_to_request = torch.tensor([1, 0, 1])
    q2 = randn(generator, (7, 2, 1, 64))
    k2 = randn(generator, (2, 4, 1, 64))
    torch.testing.assert_close(
        torch.ops.ikbo.attention(
            q2, k2, k2, cand_to_vendor, levels=[vendor_to_user, user_to_request]
        ),
        torch.ops.ikbo.attention(q2, k2, k2, user_to_request[composed]),
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize(
    ("levels", "cand_to_vendor", "message"),
    [
        ([torch.tensor([0, 3, 1])], [0, 1, 2], "levels[0][1] = 3 is out of range [0, 3)"),
        ([torch.tensor([0, 1, 1])], [0, 3, 2], "cand_to_user[1] = 3 is out of range [0, 3)"),
        (
            [torch.tensor([0.0, 1.0])],
            [0, 1, 1],
            "levels[0] must have dtype int32 or int64, got float32",
        ),
        (
            [torch.zeros(2, 1, dtype=torch.int64)],
            [0, 1, 1],
            "levels[0] must have 1 dimension, got 2",
        ),
        (
            [torch.tensor([0, 1, 1]), torch.zeros(0, dtype=torch.int64)],
            [0, 1, 1],
            "levels[1] has no entries, but the candidates reach the users through it",
        ),
    ],
)
def test_levels_are_checked_by_name(levels, cand_to_vendor, message):
    """Each wrong level is named; a request without candidates reads none
    (an empty vendor list is then fine)."""
    generator = torch.Generator().manual_seed(32)
    q, k = randn(generator, (3, 1, 1, 64)), randn(generator, (3, 4, 1, 64))
    mapping = torch.tensor(cand_to_vendor)
    with pytest.raises(ValueError) as error:
        torch.ops.ikbo.attention(q, k, k, mapping, levels=levels)
    assert message in str(error.value)
    no_candidates = torch.zeros(0, dtype=torch.int64)
    empty = torch.ops.ikbo.attention(q[:0], k, k, no_candidates, levels=[no_candidates])
    assert empty.shape == (0, 1, 1, 64)


def test_in_place_updates_invalidate_cached_state():
    w_c, w_u, e_c, e_u, cand_to_user = lce_inputs(torch.Generator().manual_seed(9))
    torch.ops.ikbo.lce(w_c, w_u, e_c, e_u, cand_to_user)
    cand_to_user[0] = 1  # the next request written into the same buffer
    with torch.no_grad():
        w_u.mul_(-2)  # new weights loaded in place
    out = torch.ops.ikbo.lce(w_c, w_u, e_c, e_u, cand_to_user)
    assert_close(out, lce_reference(w_c, w_u, e_c, e_u, cand_to_user), "float32")


def test_inference_tensors_are_compared_by_contents():
    with torch.inference_mode():
        w_c, w_u, e_c, e_u, cand_to_user = lce_inputs(torch.Generator().manual_seed(10))
        torch.ops.ikbo.lce(w_c, w_u, e_c, e_u, cand_to_user)
        maps = counting("CandidateMap")
        torch.ops.ikbo.lce(w_c, w_u, e_c, e_u, cand_to_user)
        assert counting("CandidateMap") == maps
        cand_to_user[0] = 1
        out = torch.ops.ikbo.lce(w_c, w_u, e_c, e_u, cand_to_user)
    assert counting("CandidateMap") == maps + 1
    assert_close(out, lce_reference(w_c, w_u, e_c, e_u, cand_to_user), "float32")


def test_cache_entries_go_away_with_their_tensors():
    cand_to_user = torch.tensor([0, 0, 1, 1, 2, 2, 2])
    gc.collect()  # drop what earlier tests left behind in reference cycles
    entries = len(torch_ops._CACHE._entries)
    torch_ops.candidate_map(cand_to_user, 3)
    assert len(torch_ops._CACHE._entries) == entries + 1
    del cand_to_user
    gc.collect()
    assert len(torch_ops._CACHE._entries) == entries


def test_candidate_map_takes_an_int_count():
    cand_to_user = torch.tensor([0, 1, 1])
    for num_users in ("2", 2.0, True):
        with pytest.raises(TypeError, match="num_users must be an int, got"):
            torch_ops.candidate_map(cand_to_user, num_users)
    assert torch_ops.candidate_map(cand_to_user, np.int64(2)).num_users == 2


def test_candidate_map_is_the_shared_one():
    cand_to_user = torch.tensor([1, 1, 0], dtype=torch.int32)
    mapping = torch_ops.candidate_map(cand_to_user, 2)
    assert mapping is torch_ops.candidate_map(cand_to_user, 2)
    assert mapping.num_users == 2 and mapping.user_counts.tolist() == [1, 2]
    assert torch_ops.candidate_map(cand_to_user, 3).num_users == 3


def test_writes_behind_the_version_counter():
    """A storage swapped by .data = is seen; CPU mappings are compared by
    contents, so a numpy buffer refilled in place (zero-copy serving) reaches
    the next op; a weight written behind the version counter (through .data
    or numpy) is seen once invalidated."""
    generator = torch.Generator().manual_seed(22)
    _, _, e_c, e_u, cand_to_user = lce_inputs(generator)
    weight = torch.nn.Parameter(randn(generator, (11, 9 + 6)))

    def run(weight, cand_to_user):
        w_c, w_u = weight[:, :9], weight[:, 9:]
        out = torch.ops.ikbo.lce(w_c, w_u, e_c, e_u, cand_to_user)
        assert_close(out, lce_reference(w_c, w_u, e_c, e_u, cand_to_user), "float32")

    with torch.no_grad():
        run(weight, cand_to_user)
        weight.mul_(-2)  # through the version counter
        run(weight, cand_to_user)
        weight.data = randn(generator, tuple(weight.shape))  # another storage
        run(weight, cand_to_user)
        weight.data.mul_(-2)  # behind the version counter
        torch_ops.invalidate(weight)
        run(weight, cand_to_user)

    rng = np.random.default_rng(22)
    weight_buffer, mapping_buffer = np.zeros((11, 15), np.float32), np.zeros(7, np.int64)
    weight, cand_to_user = torch.from_numpy(weight_buffer), torch.from_numpy(mapping_buffer)
    maps = counting("CandidateMap")
    for request in range(3):
        weight_buffer[:] = rng.standard_normal(weight_buffer.shape)
        torch_ops.invalidate(weight)
        mapping_buffer[:] = rng.integers(0, 3, 7)
        run(weight, cand_to_user)
        run(weight, cand_to_user)  # unchanged: reused
        assert counting("CandidateMap") == maps + request + 1


def test_invalidate_and_clear_cache():
    w_c, w_u, e_c, e_u, cand_to_user = lce_inputs(torch.Generator().manual_seed(23))
    torch.ops.ikbo.lce(w_c, w_u, e_c, e_u, cand_to_user)
    plans, maps = counting("LcePlan"), counting("CandidateMap")
    torch_ops.invalidate(w_u.data)  # any tensor on the same storage
    torch.ops.ikbo.lce(w_c, w_u, e_c, e_u, cand_to_user)
    assert counting("LcePlan") == plans + 1 and counting("CandidateMap") == maps
    torch_ops.clear_cache()
    assert not torch_ops._CACHE._entries
    torch.ops.ikbo.lce(w_c, w_u, e_c, e_u, cand_to_user)
    assert counting("LcePlan") == plans + 2 and counting("CandidateMap") == maps + 1


@needs_cuda
def test_device_copies_of_maps_and_offsets_come_from_torchs_allocator():
    """A request's map and jagged offsets keep their device copies in memory
    from torch's caching allocator (no cudaMalloc/cudaFree per request),
    released with the request's tensors."""
    gc.collect()
    before = torch.cuda.memory_allocated()
    cand_to_user = torch.tensor([0, 2, 1, 1, 0], dtype=torch.int32, device="cuda")
    kv_offsets = torch.tensor([0, 4, 4, 9], dtype=torch.int32, device="cuda")
    inputs = torch.cuda.memory_allocated()
    torch_ops.candidate_map(cand_to_user, 3)
    mapped = torch.cuda.memory_allocated()
    assert mapped - inputs >= ikbo.CandidateMap.device_bytes(5, 3)
    torch_ops._jagged_offsets(kv_offsets, 9)
    assert torch.cuda.memory_allocated() - mapped >= ikbo.JaggedOffsets.device_bytes(3)
    del cand_to_user, kv_offsets
    gc.collect()
    assert torch.cuda.memory_allocated() == before


@needs_cuda
def test_cuda_writes_behind_the_version_counter_need_invalidate():
    """On CUDA the version counter and the storage tell a change; a write
    through .data is seen once the tensor is invalidated."""
    w_c, w_u, e_c, e_u, cand_to_user = lce_inputs(torch.Generator().manual_seed(24), device="cuda")

    def run():
        out = torch.ops.ikbo.lce(w_c, w_u, e_c, e_u, cand_to_user)
        assert_close(out, lce_reference(w_c, w_u, e_c, e_u, cand_to_user.cpu()), "float32")

    run()
    w_u.mul_(-2)
    run()
    w_u.data = torch.randn(w_u.shape, generator=torch.Generator().manual_seed(25)).to(w_u)
    run()
    w_u.data.mul_(3)
    torch_ops.invalidate(w_u)
    run()


def ranking_step(w_c, w_u, e_c, e_u, q, k, v, x_c, x_u, weight, cand_to_user):
    compressed = torch.ops.ikbo.lce(w_c, w_u, e_c, e_u, cand_to_user)
    attended = torch.ops.ikbo.attention(q, k, v, cand_to_user)
    projected = torch.ops.ikbo.linear(weight[:, 3:], weight[:, :3], x_c, x_u, cand_to_user)
    return compressed.sum(-1), attended.flatten(1), projected


def ranking_inputs(generator):
    w_c, w_u, e_c, e_u, cand_to_user = lce_inputs(generator)
    return (
        w_c,
        w_u,
        e_c,
        e_u,
        randn(generator, (7, 2, 2, 64)),
        randn(generator, (3, 5, 2, 64)),
        randn(generator, (3, 5, 2, 64)),
        randn(generator, (7, 4)),
        randn(generator, (3, 3)),
        randn(generator, (6, 7)),
        cand_to_user,
    )


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(compiler):
    inputs = ranking_inputs(torch.Generator().manual_seed(12))
    compiled = torch.compile(ranking_step, fullgraph=True, backend=compiler)
    for got, want in zip(compiled(*inputs), ranking_step(*inputs)):
        torch.testing.assert_close(got, want)


def request_inputs(generator, batch, users, device="cpu"):
    """ranking_step's inputs for a request of `batch` candidates of `users`
    users, with a drawn mapping."""
    m, ku, kc, n = 11, 6, 9, 5

    def draw(*shape):
        return randn(generator, shape, device=device)

    cand_to_user = torch.randint(0, users, (batch,), generator=generator, dtype=torch.int32)
    return (
        draw(m, kc) / kc**0.5,
        draw(m, ku) / ku**0.5,
        draw(batch, kc, n),
        draw(users, ku, n),
        draw(batch, 2, 2, 64),
        draw(users, 5, 2, 64),
        draw(users, 5, 2, 64),
        draw(batch, 4),
        draw(users, 3),
        draw(6, 7),
        cand_to_user.to(device),
    )


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_torch_compile_with_dynamic_shapes(device):
    """One graph traced with symbolic sizes serves requests of other B and U:
    the fake implementations size the outputs from the inputs."""
    torch._dynamo.reset()
    compiled = torch.compile(ranking_step, backend="aot_eager", dynamic=True, fullgraph=True)
    generator = torch.Generator().manual_seed(17)
    for batch, users in [(7, 3), (11, 3), (13, 5), (64, 7)]:
        inputs = request_inputs(generator, batch, users, device)
        for got, want in zip(compiled(*inputs), ranking_step(*inputs)):
            torch.testing.assert_close(got, want)


@needs_cuda
def test_reduce_overhead_takes_a_new_mapping_on_every_call():
    """mode="reduce-overhead" replays its CUDA graphs with new inputs copied in;
    the ops, tagged cudagraph_unsafe, run outside them, so each request's
    mapping is its own (a captured map would be the first request's)."""
    torch._dynamo.reset()
    compiled = torch.compile(ranking_step, mode="reduce-overhead", fullgraph=True)
    generator = torch.Generator().manual_seed(18)
    for _ in range(4):
        inputs = request_inputs(generator, 9, 3, "cuda")
        for got, want in zip(compiled(*inputs), ranking_step(*inputs)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_torch_export_keeps_the_ops():
    class Step(torch.nn.Module):
        def forward(self, *inputs):
            return ranking_step(*inputs)

    inputs = ranking_inputs(torch.Generator().manual_seed(13))
    exported = torch.export.export(Step(), inputs)
    targets = {str(node.target) for node in exported.graph.nodes}
    assert {"ikbo.lce.default", "ikbo.attention.default", "ikbo.linear.default"} <= targets
    for got, want in zip(exported.module()(*inputs), ranking_step(*inputs)):
        torch.testing.assert_close(got, want)


def test_torch_export_with_dynamic_sizes():
    """The fake implementations' checks hold for symbolic B and U from 0 up."""

    class Step(torch.nn.Module):
        def forward(self, w_c, w_u, e_c, e_u, q, k, v, x_c, x_u, weight, cand_to_user):
            return ranking_step(w_c, w_u, e_c, e_u, q, k, v, x_c, x_u, weight, cand_to_user)

    batch, users = torch.export.Dim("batch"), torch.export.Dim("users")
    b, u = {0: batch}, {0: users}
    generator = torch.Generator().manual_seed(25)
    exported = torch.export.export(
        Step(),
        request_inputs(generator, 7, 3),
        dynamic_shapes=(None, None, b, u, b, u, u, b, u, None, b),
    )
    for batch_size, num_users in [(11, 5), (2, 2), (0, 3)]:
        inputs = request_inputs(generator, batch_size, num_users)
        for got, want in zip(exported.module()(*inputs), ranking_step(*inputs)):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_users_without_candidates_and_empty_batches(device):
    """Every op with a user that no candidate maps to, and with B = 0."""
    generator = torch.Generator().manual_seed(17)
    w_c, w_u, e_c, e_u, _ = lce_inputs(generator, torch.float32, device)
    starved = torch.tensor([2, 0, 0, 2, 0, 2, 0], dtype=torch.int32, device=device)  # not user 1
    out = torch.ops.ikbo.lce(w_c, w_u, e_c, e_u, starved)
    assert_close(out, lce_reference(w_c, w_u, e_c, e_u, starved.cpu()), "float32")
    assert torch.ops.ikbo.lce(w_c, w_u, e_c[:0], e_u, starved[:0]).shape == (0, 11, 5)

    q = randn(generator, (7, 3, 2, 64), device=device)
    k = randn(generator, (3, 10, 2, 64), device=device)
    v = randn(generator, (3, 10, 2, 64), device=device)
    out = torch.ops.ikbo.attention(q, k, v, starved)
    assert_close(out, attention_reference(q, k, v, starved.cpu()), "float32")
    assert torch.ops.ikbo.attention(q[:0], k, v, starved[:0]).shape == (0, 3, 2, 64)

    weight = randn(generator, (6, 4 + 5), device=device)
    x_c, x_u = randn(generator, (7, 5), device=device), randn(generator, (3, 4), device=device)
    out = torch.ops.ikbo.linear(weight[:, 4:], weight[:, :4], x_c, x_u, starved)
    expected = linear_reference(weight[:, 4:], weight[:, :4], x_c, x_u, starved)
    assert_close(out, expected, "float32")
    empty = torch.ops.ikbo.linear(weight[:, 4:], weight[:, :4], x_c[:0], x_u, starved[:0])
    assert empty.shape == (0, 6)


@needs_cuda
@pytest.mark.parametrize("dtype_name", TORCH_DTYPES)
def test_cuda_ops_match_references(dtype_name):
    dtype = TORCH_DTYPES[dtype_name]
    generator = torch.Generator().manual_seed(14)
    w_c, w_u, e_c, e_u, cand_to_user = lce_inputs(generator, dtype, "cuda")
    out = torch.ops.ikbo.lce(w_c, w_u, e_c, e_u, cand_to_user.long())
    assert out.is_cuda
    assert_close(out, lce_reference(w_c, w_u, e_c, e_u, cand_to_user.cpu()), dtype_name)
    q, k = (
        randn(generator, (7, 3, 2, 128), dtype, "cuda"),
        randn(generator, (3, 9, 2, 128), dtype, "cuda"),
    )
    out = torch.ops.ikbo.attention(q, k, k, cand_to_user)
    assert_close(out, attention_reference(q, k, k, cand_to_user.cpu()), dtype_name)
    x_c, x_u = randn(generator, (7, 5), dtype, "cuda"), randn(generator, (3, 4), dtype, "cuda")
    weight, bias = randn(generator, (6, 9), dtype, "cuda"), randn(generator, (6,), dtype, "cuda")
    out = torch.ops.ikbo.linear(weight[:, 4:], weight[:, :4], x_c, x_u, cand_to_user, bias)
    assert_close(
        out,
        linear_reference(weight[:, 4:], weight[:, :4], x_c, x_u, cand_to_user, bias),
        dtype_name,
    )


def capture_after_warm_up(step, inputs):
    """(graph, output) of ``step(*inputs)`` captured after one warm-up pass on
    a side stream, which builds the map and the plans outside the capture."""
    warm_up = torch.cuda.Stream()
    warm_up.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm_up):
        step(*inputs)
    torch.cuda.current_stream().wait_stream(warm_up)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = step(*inputs)
    return graph, output


@needs_cuda
def test_cuda_graph_capture_after_warm_up():
    inputs = [value.cuda() for value in ranking_inputs(torch.Generator().manual_seed(15))]
    graph, captured = capture_after_warm_up(ranking_step, inputs)
    generator = torch.Generator().manual_seed(16)
    for position in (2, 4, 7):  # new e_c, q, x_c for the same mapping
        inputs[position].copy_(torch.randn(inputs[position].shape, generator=generator))
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, ranking_step(*inputs)):
        torch.testing.assert_close(got, want)


@needs_cuda
def test_cuda_graph_capture_without_a_prepared_map_is_refused():
    w_c, w_u, e_c, e_u, _ = lce_inputs(torch.Generator().manual_seed(16), device="cuda")
    torch.ops.ikbo.lce(w_c, w_u, e_c, e_u, torch.zeros(7, dtype=torch.int32, device="cuda"))
    fresh_mapping = torch.ones(7, dtype=torch.int32, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="before capturing"), torch.cuda.graph(graph):
        torch.ops.ikbo.lce(w_c, w_u, e_c, e_u, fresh_mapping)


@needs_cuda
def test_cuda_graph_capture_of_a_multi_level_rewrite():
    """A model whose history reaches the candidates through a vendor level,
    rewritten: the ops take the levels, so the warm-up's map serves the
    capture (a composed index made inside each pass would not be found)."""
    from ikbo import rewrite

    class ThroughVendors(torch.nn.Module):
        def forward(self, q, history, vendor_to_user, cand_to_vendor):
            replicated = history[vendor_to_user][cand_to_vendor].transpose(1, 2)
            return torch.nn.functional.scaled_dot_product_attention(q, replicated, replicated)

    generator = torch.Generator().manual_seed(33)
    inputs = [
        randn(generator, (9, 2, 3, 64), torch.float16, "cuda"),
        randn(generator, (3, 10, 2, 64), torch.float16, "cuda"),
        torch.tensor([2, 0, 2, 1], device="cuda"),
        torch.tensor([3, 3, 0, 1, 2, 2, 0, 1, 3], device="cuda"),
    ]
    model = ThroughVendors()
    rewritten = rewrite.optimize(model, inputs, verbose=False)
    (item,) = rewritten.ikbo_report.rewritten
    assert item.mapping == "cand_to_user = vendor_to_user[cand_to_vendor]"
    graph, captured = capture_after_warm_up(rewritten, inputs)
    inputs[0].copy_(randn(generator, (9, 2, 3, 64), torch.float16))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, model(*inputs), rtol=2e-3, atol=2e-3)


def test_nothing_is_reported_leaked_at_exit():
    """The cache's library objects are freed at exit, before the extension:
    here an autograd graph still held at exit kept them alive past it, and
    nanobind reported them as leaked. Backward itself is refused by name."""
    script = textwrap.dedent(
        """
        import torch, ikbo.torch_ops
        w_c = torch.randn(16, 8, requires_grad=True)
        w_u = torch.randn(16, 8, requires_grad=True)
        index = torch.arange(6) % 2
        out = torch.ops.ikbo.linear(w_c, w_u, torch.randn(6, 8), torch.randn(2, 8), index, None)
        try:
            out.sum().backward()
        except RuntimeError as error:
            print(error)
        """
    )
    result = run_with_leak_warnings(script, "1")
    assert result.returncode == 0, result.stderr
    assert "ikbo::linear is inference-only" in result.stdout
    assert "leaked" not in result.stderr, result.stderr


def run_with_leak_warnings(script, setting):
    """Runs `script` in a new interpreter with IKBO_LEAK_WARNINGS = `setting`
    (None: unset), which turns on nanobind's report of ikbo objects alive at
    exit."""
    environment = {key: value for key, value in os.environ.items() if key != "IKBO_LEAK_WARNINGS"}
    if setting is not None:
        environment["IKBO_LEAK_WARNINGS"] = setting
    return subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        capture_output=True,
        text=True,
        env=environment,
    )


def test_a_users_module_level_objects_are_not_reported_at_exit():
    """torch.compile's guards (in torch 2.11) keep __main__'s globals past the
    extension's teardown, so a script's module-level plan and map are alive
    then, by no fault of the script's: nanobind's leak report stays off."""
    script = textwrap.dedent(
        """
        import torch, ikbo.torch_ops
        plan = ikbo.LcePlan(torch.randn(4, 3), torch.randn(4, 2))
        index = torch.tensor([0, 1, 1], dtype=torch.int32)
        mapping = ikbo.torch_ops.candidate_map(index, 2)

        @torch.compile(backend="eager")
        def forward(e_c):
            return torch.ops.ikbo.lce(
                torch.ones(4, 3), torch.ones(4, 2), e_c, torch.ones(2, 2, 5), index
            )

        print(forward(torch.ones(3, 3, 5)).shape)
        """
    )
    for setting in (None, "0"):
        result = run_with_leak_warnings(script, setting)
        assert result.returncode == 0, result.stderr
        assert "torch.Size([3, 4, 5])" in result.stdout
        assert "leaked" not in result.stderr, result.stderr


def test_ikbo_leak_warnings_turns_the_report_on():
    """A plan whose reference count is raised by hand is alive at exit on any
    torch: nanobind names it only under IKBO_LEAK_WARNINGS=1."""
    script = textwrap.dedent(
        """
        import ctypes
        import numpy as np
        import ikbo
        plan = ikbo.LcePlan(np.ones((4, 3), np.float32), np.ones((4, 2), np.float32))
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(plan))
        """
    )
    quiet = run_with_leak_warnings(script, None)
    assert quiet.returncode == 0 and "leaked" not in quiet.stderr, quiet.stderr
    reported = run_with_leak_warnings(script, "1")
    assert reported.returncode == 0, reported.stderr
    assert "leaked instance" in reported.stderr and "ikbo._C.LcePlan" in reported.stderr
