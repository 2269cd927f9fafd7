"""ikbo.linear on numpy (CPU backend) against a float64 reference: torch's
weight or a LinearPlan, with and without bias, and its errors."""

import re

import numpy as np
import pytest

import ikbo
from reference import as_float64, assert_close, random_mapping

# name: (N_out, Ku, Kc, B, U, sorted, users without candidates)
SHAPES = {
    "reference-widths": (256, 118, 866, 9, 3, False, ()),
    "single-everything": (1, 1, 1, 1, 1, True, ()),
    "unsorted-empty-users": (17, 9, 13, 11, 6, False, (1, 4)),
    "one-user-per-candidate": (19, 24, 40, 9, 9, False, ()),
}
DTYPES = {"float16": np.float16, "float32": np.float32}
SENTINEL = 7.0


def linear_reference(weight, x_c, x_u, cand_to_user, bias=None):
    """torch.nn.functional.linear(cat([x_u[cand_to_user], x_c], -1), weight, bias) in float64."""
    mapping = np.asarray(cand_to_user, dtype=np.int64)
    features = np.concatenate([as_float64(x_u)[mapping], as_float64(x_c)], axis=1)
    y = features @ as_float64(weight).T
    return y if bias is None else y + as_float64(bias)


def make_inputs(seed, shape, dtype):
    out_features, ku, kc, num_candidates, num_users, sort, empty_users = shape
    rng = np.random.default_rng(seed)
    # Scaled so every output entry has unit order of magnitude in any dtype.
    weight = (rng.standard_normal((out_features, ku + kc)) / np.sqrt(ku + kc)).astype(dtype)
    bias = rng.standard_normal(out_features).astype(dtype)
    x_c = rng.standard_normal((num_candidates, kc)).astype(dtype)
    x_u = rng.standard_normal((num_users, ku)).astype(dtype)
    cand_to_user = random_mapping(rng, num_candidates, num_users, sort, empty_users)
    return weight, bias, x_c, x_u, cand_to_user


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("shape_name", SHAPES)
def test_linear_with_torch_weight_into_poisoned_out(shape_name, dtype_name, with_bias):
    weight, bias, x_c, x_u, cand_to_user = make_inputs(
        list(SHAPES).index(shape_name), SHAPES[shape_name], DTYPES[dtype_name]
    )
    bias = bias if with_bias else None
    out = np.full((x_c.shape[0], weight.shape[0]), np.nan, dtype=DTYPES[dtype_name])
    result = ikbo.linear(weight, x_c, x_u, cand_to_user, bias=bias, out=out)
    assert result is out
    assert_close(out, linear_reference(weight, x_c, x_u, cand_to_user, bias), dtype_name)


def test_linear_plan_and_map_are_reused_across_requests():
    weight, bias, x_c, x_u, cand_to_user = make_inputs(
        7, SHAPES["unsorted-empty-users"], np.float32
    )
    ku = x_u.shape[1]
    # The plan takes the column blocks of torch's weight in the order [w_u | w_c].
    plan = ikbo.LinearPlan(
        np.ascontiguousarray(weight[:, :ku]), np.ascontiguousarray(weight[:, ku:]), bias
    )
    assert (plan.out_features, plan.ku, plan.kc, plan.has_bias) == (17, 9, 13, True)
    assert (plan.dtype, plan.device) == ("float32", "cpu")
    assert repr(plan).startswith("LinearPlan(out_features=17, ku=9, kc=13, has_bias=True")
    candidate_map = ikbo.CandidateMap(cand_to_user, x_u.shape[0])
    out = ikbo.linear(plan, x_c, x_u, candidate_map)
    assert isinstance(out, np.ndarray)
    assert out.dtype == np.float32 and out.shape == (x_c.shape[0], 17)
    assert_close(out, linear_reference(weight, x_c, x_u, cand_to_user, bias), "float32")
    other_c, other_u, other_map = x_c[:3].copy(), x_u[:2].copy(), [1, 1, 0]
    assert_close(
        ikbo.linear(plan, other_c, other_u, other_map, num_user_features=ku),
        linear_reference(weight, other_c, other_u, other_map, bias),
        "float32",
    )


def test_concatenated_plan_equals_split_plan_bitwise():
    weight, bias, x_c, x_u, cand_to_user = make_inputs(8, SHAPES["reference-widths"], np.float16)
    ku = x_u.shape[1]
    concatenated = ikbo.LinearPlan.from_concatenated(weight, ku, bias)
    split = ikbo.LinearPlan(
        np.ascontiguousarray(weight[:, :ku]), np.ascontiguousarray(weight[:, ku:]), bias
    )
    np.testing.assert_array_equal(
        ikbo.linear(concatenated, x_c, x_u, cand_to_user),
        ikbo.linear(split, x_c, x_u, cand_to_user),
    )


def test_num_user_features_splits_the_weight():
    weight, _, x_c, x_u, cand_to_user = make_inputs(9, SHAPES["single-everything"], np.float32)
    out = ikbo.linear(weight, x_c, x_u, cand_to_user, num_user_features=1)
    assert_close(out, linear_reference(weight, x_c, x_u, cand_to_user), "float32")


def test_linear_zero_candidates():
    weight, bias, _, x_u, _ = make_inputs(10, SHAPES["unsorted-empty-users"], np.float16)
    x_c = np.zeros((0, weight.shape[1] - x_u.shape[1]), dtype=np.float16)
    out = ikbo.linear(weight, x_c, x_u, np.zeros(0, dtype=np.int32), bias=bias)
    assert out.shape == (0, weight.shape[0])


@pytest.fixture
def small_inputs():
    weight, bias, x_c, x_u, _ = make_inputs(11, (6, 4, 5, 3, 2, True, ()), np.float16)
    cand_to_user = np.array([1, 0, 1], dtype=np.int32)
    out = np.full((3, 6), SENTINEL, dtype=np.float16)
    return weight, bias, x_c, x_u, cand_to_user, out


def expect_untouched(out):
    assert (out == SENTINEL).all(), "out was written by a call that failed"


@pytest.mark.parametrize(
    "mutate, message",
    [
        (
            lambda a: a.update(x_c=a["x_c"].astype(np.float32)),
            "x_c must have dtype float16, got float32",
        ),
        (
            lambda a: a.update(x_c=a["x_c"][:, :4].copy()),
            (
                "x_u dimension 1 (Ku) plus x_c dimension 1 (Kc) must be 9, the columns of weight "
                "[N_out, Ku + Kc] (shape [6, 9]), got 4 + 4 (x_u shape [2, 4], x_c shape [3, 4])"
            ),
        ),
        (
            lambda a: a.update(x_c=a["x_c"][:, :4].copy(), num_user_features=4),
            "x_c dimension 1 must be 5 (Kc of w_c), got 4",
        ),
        (
            lambda a: a.update(x_u=a["x_u"][:, :3].copy()),
            (
                "x_u dimension 1 (Ku) plus x_c dimension 1 (Kc) must be 9, the columns of weight "
                "[N_out, Ku + Kc] (shape [6, 9]), got 3 + 5 (x_u shape [2, 3], x_c shape [3, 5])"
            ),
        ),
        (
            lambda a: a.update(x_u=np.ones((2, 9), np.float16)),
            "x_u dimension 1 (Ku) plus x_c dimension 1 (Kc) must be 9",
        ),
        (
            lambda a: a.update(bias=a["bias"][:5].copy()),
            "bias dimension 0 must be 6 (N_out of weight), got 5",
        ),
        (
            lambda a: a.update(cand_to_user_or_map=np.array([0, 2, 1], dtype=np.int32)),
            "cand_to_user[1] = 2 is out of range [0, 2)",
        ),
        (
            lambda a: a.update(num_user_features=9),
            "num_user_features (Ku) must be in [1, 8]",
        ),
        (
            lambda a: a.update(out=np.full((3, 5), SENTINEL, dtype=np.float16)),
            "out must have shape [3, 6] ([B, N_out]), got [3, 5]",
        ),
    ],
)
def test_invalid_arguments_leave_out_untouched(small_inputs, mutate, message):
    weight, bias, x_c, x_u, cand_to_user, out = small_inputs
    arguments = {
        "weight_or_plan": weight,
        "x_c": x_c,
        "x_u": x_u,
        "cand_to_user_or_map": cand_to_user,
        "bias": bias,
        "out": out,
    }
    mutate(arguments)
    with pytest.raises(ValueError, match=re.escape(message)):
        ikbo.linear(**arguments)
    expect_untouched(arguments["out"])


def test_plan_holds_the_bias_and_ku(small_inputs):
    weight, bias, x_c, x_u, cand_to_user, out = small_inputs
    plan = ikbo.LinearPlan.from_concatenated(weight, x_u.shape[1], bias)
    with pytest.raises(ValueError, match="bias must be None when weight_or_plan is a LinearPlan"):
        ikbo.linear(plan, x_c, x_u, cand_to_user, bias=bias, out=out)
    with pytest.raises(ValueError, match="num_user_features = 3 disagrees with the LinearPlan's"):
        ikbo.linear(plan, x_c, x_u, cand_to_user, num_user_features=3, out=out)
    expect_untouched(out)


def test_plan_with_one_dimensional_candidate_features_is_rejected(small_inputs):
    weight, bias, x_c, x_u, cand_to_user, out = small_inputs
    plan = ikbo.LinearPlan.from_concatenated(weight, x_u.shape[1], bias)
    with pytest.raises(ValueError, match=r"x_c must have 2 dimensions"):
        ikbo.linear(plan, x_c.reshape(-1), x_u, cand_to_user, out=out)
    expect_untouched(out)


def test_workspace_bytes_from_sizes_match_and_are_checked(small_inputs):
    weight, bias, x_c, x_u, cand_to_user, _ = small_inputs
    plan = ikbo.LinearPlan.from_concatenated(weight, x_u.shape[1], bias)
    mapping = ikbo.CandidateMap(cand_to_user, x_u.shape[0])
    from_inputs = ikbo._C.linear_workspace_bytes(plan, x_c, x_u, mapping)
    assert ikbo._C.linear_workspace_bytes(plan, x_c.shape[0], x_u.shape[0]) == from_inputs
    with pytest.raises(
        ValueError, match=re.escape("num_users (U) must be in [1, 2147483647], got 0")
    ):
        ikbo._C.linear_workspace_bytes(plan, x_c.shape[0], 0)


def test_raw_weight_needs_two_dimensional_user_features(small_inputs):
    weight, _, x_c, x_u, cand_to_user, out = small_inputs
    message = "x_u must have 2 dimensions, got 1 (shape [8])"
    with pytest.raises(ValueError, match=re.escape(message)):
        ikbo.linear(weight, x_c, x_u.reshape(-1), cand_to_user, out=out)
    expect_untouched(out)


@pytest.mark.parametrize("state", ["weight", "weight-and-ku", "plan"])
def test_scalar_user_features_are_named(small_inputs, state):
    """U (and with a raw weight Ku) is read from x_u before the library sees
    it: a 0-d x_u is a ValueError naming it, not an IndexError."""
    weight, bias, x_c, _, cand_to_user, out = small_inputs
    arguments = {"weight_or_plan": weight, "bias": bias}
    if state == "weight-and-ku":
        arguments["num_user_features"] = 4
    elif state == "plan":
        arguments = {"weight_or_plan": ikbo.LinearPlan.from_concatenated(weight, 4, bias)}
    with pytest.raises(ValueError, match=re.escape("x_u must have 2 dimensions, got 0 (shape [])")):
        ikbo.linear(
            x_c=x_c,
            x_u=np.array(1.0, dtype=np.float16),
            cand_to_user_or_map=cand_to_user,
            out=out,
            **arguments,
        )
    expect_untouched(out)


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_linear_matches_torch_functional_linear(device, dtype_name):
    """torch tensors (bfloat16 included, on the GPU where there is one) against
    torch.nn.functional.linear over the concatenated, replicated features."""
    torch = pytest.importorskip("torch", reason="torch is not importable")
    if device == "cuda" and not (ikbo.cuda_device_count() > 0 and torch.cuda.is_available()):
        pytest.skip("no CUDA device for ikbo and torch")
    dtype = getattr(torch, dtype_name)
    generator = torch.Generator().manual_seed(3)
    out_features, ku, kc, num_candidates, num_users = 45, 37, 70, 29, 5
    weight = torch.randn((out_features, ku + kc), generator=generator) / (ku + kc) ** 0.5
    bias = torch.randn(out_features, generator=generator)
    x_c = torch.randn((num_candidates, kc), generator=generator)
    x_u = torch.randn((num_users, ku), generator=generator)
    mapping = random_mapping(np.random.default_rng(3), num_candidates, num_users, False, (2,))
    weight, bias, x_c, x_u = (t.to(device=device, dtype=dtype) for t in (weight, bias, x_c, x_u))
    cand_to_user = torch.from_numpy(mapping).to(device)
    out = ikbo.linear(weight, x_c, x_u, cand_to_user, bias=bias)
    assert isinstance(out, torch.Tensor)
    assert out.dtype == dtype and out.device == x_c.device
    assert out.shape == (num_candidates, out_features)
    replicated = torch.cat([x_u[cand_to_user.long()], x_c], dim=-1)
    expected = torch.nn.functional.linear(replicated.double(), weight.double(), bias.double())
    assert_close(out, expected.cpu().numpy(), dtype_name)
