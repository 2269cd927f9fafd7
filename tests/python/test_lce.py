"""ikbo.lce on numpy (CPU backend) against a float64 reference."""

import numpy as np
import pytest

import ikbo
from reference import assert_close, lce_reference, random_mapping

# name: (M, Ku, Kc, N, B, U, sorted, users without candidates)
SHAPES = {
    "odd-reference-m-kc": (433, 118, 866, 3, 7, 3, True, ()),
    "single-everything": (5, 3, 4, 1, 1, 1, True, ()),
    "unsorted-empty-users": (17, 9, 13, 5, 11, 6, False, (1, 4)),
    "k-of-one": (8, 1, 1, 7, 4, 2, False, ()),
    "wide-n-one-user-per-candidate": (19, 24, 40, 64, 9, 9, False, ()),
}
DTYPES = {"float16": np.float16, "float32": np.float32}


def make_inputs(seed, shape, dtype):
    m, ku, kc, n, num_candidates, num_users, sort, empty_users = shape
    rng = np.random.default_rng(seed)
    # Scaled so every output entry has unit order of magnitude in any dtype.
    w_c = (rng.standard_normal((m, kc)) / np.sqrt(kc)).astype(dtype)
    w_u = (rng.standard_normal((m, ku)) / np.sqrt(ku)).astype(dtype)
    e_c = rng.standard_normal((num_candidates, kc, n)).astype(dtype)
    e_u = rng.standard_normal((num_users, ku, n)).astype(dtype)
    cand_to_user = random_mapping(rng, num_candidates, num_users, sort, empty_users)
    return w_c, w_u, e_c, e_u, cand_to_user


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("shape_name", SHAPES)
def test_lce_into_poisoned_out(shape_name, dtype_name):
    w_c, w_u, e_c, e_u, cand_to_user = make_inputs(
        list(SHAPES).index(shape_name), SHAPES[shape_name], DTYPES[dtype_name]
    )
    out = np.full((e_c.shape[0], w_c.shape[0], e_c.shape[2]), np.nan, dtype=DTYPES[dtype_name])
    result = ikbo.lce(w_c, w_u, e_c, e_u, cand_to_user, out=out)
    assert result is out
    assert_close(out, lce_reference(w_c, w_u, e_c, e_u, cand_to_user), dtype_name)


def test_lce_with_prebuilt_plan_and_map_allocates_numpy_output():
    w_c, w_u, e_c, e_u, cand_to_user = make_inputs(11, SHAPES["unsorted-empty-users"], np.float32)
    plan = ikbo.LcePlan(w_c, w_u)
    candidate_map = ikbo.CandidateMap(cand_to_user, e_u.shape[0])
    out = ikbo.lce(plan, None, e_c, e_u, candidate_map)
    assert isinstance(out, np.ndarray)
    assert out.dtype == np.float32 and out.shape == (e_c.shape[0], plan.m, e_c.shape[2])
    assert_close(out, lce_reference(w_c, w_u, e_c, e_u, cand_to_user), "float32")
    # The same plan serves another request with a different batch.
    other_c, other_u, other_map = (
        e_c[:3].copy(),
        e_u[:2].copy(),
        np.array([1, 1, 0], dtype=np.int32),
    )
    assert_close(
        ikbo.lce(plan, None, other_c, other_u, other_map),
        lce_reference(w_c, w_u, other_c, other_u, other_map),
        "float32",
    )


def test_workspace_bytes_from_sizes_match_and_are_checked():
    w_c, w_u, e_c, e_u, cand_to_user = make_inputs(12, SHAPES["unsorted-empty-users"], np.float32)
    plan = ikbo.LcePlan(w_c, w_u)
    candidate_map = ikbo.CandidateMap(cand_to_user, e_u.shape[0])
    num_candidates, _, n = e_c.shape
    assert ikbo._C.lce_workspace_bytes(
        plan, n, num_candidates, e_u.shape[0]
    ) == ikbo._C.lce_workspace_bytes(plan, e_c, e_u, candidate_map)
    with pytest.raises(
        ValueError, match=r"n \(N, dimension 2 of e_c\) must be in \[1, 2147483647\], got 0"
    ):
        ikbo._C.lce_workspace_bytes(plan, 0, num_candidates, e_u.shape[0])


def test_lce_num_users_and_raw_list_mapping():
    w_c, w_u, e_c, e_u, cand_to_user = make_inputs(12, SHAPES["k-of-one"], np.float32)
    out = ikbo.lce(w_c, w_u, e_c, e_u, cand_to_user.tolist(), num_users=e_u.shape[0])
    assert_close(out, lce_reference(w_c, w_u, e_c, e_u, cand_to_user), "float32")


def test_lce_read_only_inputs():
    inputs = make_inputs(13, SHAPES["single-everything"], np.float32)
    for array in inputs:
        array.setflags(write=False)
    assert_close(ikbo.lce(*inputs), lce_reference(*inputs), "float32")


def test_lce_zero_candidates():
    w_c, w_u, _, e_u, _ = make_inputs(14, SHAPES["k-of-one"], np.float16)
    e_c = np.zeros((0, w_c.shape[1], e_u.shape[2]), dtype=np.float16)
    out = ikbo.lce(w_c, w_u, e_c, e_u, np.zeros(0, dtype=np.int32))
    assert out.shape == (0, w_c.shape[0], e_u.shape[2])


def test_fused_baseline_says_why_it_cannot_run_on_the_cpu():
    # _C.baseline.lce_fused is the Python bench's "fused" stage: a Hopper
    # kernel. On the CPU the blocker names the reason and the call refuses,
    # with out untouched; bad inputs are refused as lce refuses them.
    w_c, w_u, e_c, e_u, cand_to_user = make_inputs(15, SHAPES["k-of-one"], np.float32)
    plan = ikbo.LcePlan(w_c, w_u)
    candidate_map = ikbo.CandidateMap(cand_to_user, e_u.shape[0])
    out = np.full((e_c.shape[0], plan.m, e_c.shape[2]), np.nan, dtype=np.float32)
    reason = ikbo._C.baseline.lce_fused_blocker(plan, e_c, e_u, candidate_map, out)
    assert "on the CPU" in reason
    with pytest.raises(ValueError, match="lce_fused runs on CUDA only"):
        ikbo._C.baseline.lce_fused(plan, e_c, e_u, candidate_map, out)
    assert np.isnan(out).all()
    with pytest.raises(ValueError, match="out"):
        ikbo._C.baseline.lce_fused_blocker(plan, e_c, e_u, candidate_map, out[:, :1])
