"""ikbo.attention on numpy (CPU backend) against a float64 reference, with
dense and jagged K/V."""

import numpy as np
import pytest

import ikbo
from reference import assert_close, attention_reference, jagged_offsets, random_mapping

DTYPES = {"float16": np.float16, "float32": np.float32}

# name: (B, U, S, H, n_seed, D, sorted, users without candidates)
DENSE_SHAPES = {
    "one-seed-d64": (5, 2, 17, 2, 1, 64, True, ()),
    "odd-seeds-d128-unsorted": (7, 3, 33, 1, 37, 128, False, (1,)),
    "single-everything": (1, 1, 1, 1, 1, 64, True, ()),
    "d256-uneven": (6, 3, 70, 2, 5, 256, False, (2,)),
}

# name: (per-user lengths, B, H, n_seed, D, sorted)
JAGGED_SHAPES = {
    "empty-histories-unsorted": ((0, 5, 33, 1), 9, 2, 3, 64, False),
    "one-user-long": ((70,), 3, 1, 37, 128, True),
    "all-empty": ((0, 0), 4, 1, 2, 64, False),
    "d256-unsorted": ((65, 0, 1), 5, 2, 3, 256, False),
}


def randn(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("shape_name", DENSE_SHAPES)
def test_dense_attention_into_poisoned_out(shape_name, dtype_name):
    dtype = DTYPES[dtype_name]
    num_candidates, num_users, seq_len, heads, n_seed, head_dim, sort, empty_users = DENSE_SHAPES[
        shape_name
    ]
    rng = np.random.default_rng(list(DENSE_SHAPES).index(shape_name))
    q = randn(rng, (num_candidates, n_seed, heads, head_dim), dtype)
    k = randn(rng, (num_users, seq_len, heads, head_dim), dtype)
    v = randn(rng, (num_users, seq_len, heads, head_dim), dtype)
    cand_to_user = random_mapping(rng, num_candidates, num_users, sort, empty_users)
    out = np.full_like(q, np.nan)
    assert ikbo.attention(q, k, v, cand_to_user, out=out) is out
    assert_close(out, attention_reference(q, k, v, cand_to_user), dtype_name)


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("shape_name", JAGGED_SHAPES)
def test_jagged_attention_into_poisoned_out(shape_name, dtype_name):
    dtype = DTYPES[dtype_name]
    lengths, num_candidates, heads, n_seed, head_dim, sort = JAGGED_SHAPES[shape_name]
    rng = np.random.default_rng(10 + list(JAGGED_SHAPES).index(shape_name))
    offsets = jagged_offsets(lengths)
    total = int(offsets[-1])
    q = randn(rng, (num_candidates, n_seed, heads, head_dim), dtype)
    k = randn(rng, (total, heads, head_dim), dtype)
    v = randn(rng, (total, heads, head_dim), dtype)
    cand_to_user = random_mapping(rng, num_candidates, len(lengths), sort)
    out = np.full_like(q, np.nan)
    ikbo.attention(q, k, v, cand_to_user, kv_offsets=offsets, out=out)
    expected = attention_reference(q, k, v, cand_to_user, offsets)
    assert_close(out, expected, dtype_name)
    for candidate, user in enumerate(cand_to_user):
        if lengths[user] == 0:
            assert not out[candidate].any(), "a user without history must give zeros"


def test_attention_explicit_scale_and_prebuilt_state_allocates_numpy_output():
    rng = np.random.default_rng(21)
    lengths = (4, 0, 9)
    offsets = jagged_offsets(lengths)
    q = randn(rng, (5, 2, 2, 64), np.float32)
    k = randn(rng, (int(offsets[-1]), 2, 64), np.float32)
    v = randn(rng, (int(offsets[-1]), 2, 64), np.float32)
    cand_to_user = np.array([2, 0, 1, 2, 0], dtype=np.int32)
    candidate_map = ikbo.CandidateMap(cand_to_user, len(lengths))
    kv_offsets = ikbo.JaggedOffsets(offsets, k.shape[0])
    out = ikbo.attention(q, k, v, candidate_map, kv_offsets=kv_offsets, scale=0.3)
    assert isinstance(out, np.ndarray) and out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, attention_reference(q, k, v, cand_to_user, offsets, scale=0.3), "float32")


def test_attention_over_a_composed_map_reads_each_users_history():
    """Candidates -> vendors -> users: attention by the composed map equals
    the reference on the history replicated through both levels."""
    rng = np.random.default_rng(29)
    vendor_to_user = np.array([1, 1, 0, 3, 1], dtype=np.int32)  # user 2 has no vendor
    cand_to_vendor = random_mapping(rng, 23, len(vendor_to_user), False)
    q = randn(rng, (23, 3, 2, 64), np.float32)
    k = randn(rng, (4, 17, 2, 64), np.float32)
    v = randn(rng, (4, 17, 2, 64), np.float32)
    composed = ikbo.CandidateMap.compose(
        ikbo.CandidateMap(cand_to_vendor, len(vendor_to_user)), ikbo.CandidateMap(vendor_to_user, 4)
    )
    out = ikbo.attention(q, k, v, composed)
    expected = attention_reference(q, k[vendor_to_user], v[vendor_to_user], cand_to_vendor)
    assert_close(out, expected, "float32")
    # Built from the request's index tensors, the same map.
    from_levels = ikbo.CandidateMap(cand_to_vendor, 4, levels=[vendor_to_user])
    np.testing.assert_array_equal(from_levels.cand_to_user, composed.cand_to_user)
    np.testing.assert_array_equal(from_levels.candidates_by_user, composed.candidates_by_user)
    np.testing.assert_array_equal(ikbo.attention(q, k, v, from_levels), out)


def test_candidate_map_levels_are_a_list_tuple_or_none():
    cand_to_vendor = np.array([0, 1, 1], np.int32)
    for levels in (None, (), []):
        np.testing.assert_array_equal(
            ikbo.CandidateMap(cand_to_vendor, 2, levels=levels).cand_to_user, cand_to_vendor
        )
    with pytest.raises(TypeError) as error:
        ikbo.CandidateMap(cand_to_vendor, 2, levels=np.array([0, 1], np.int32))
    message = str(error.value)
    assert message.startswith("levels must be a list or tuple of index tensors, or None, got ")
    assert message.endswith("ndarray")


@pytest.mark.parametrize(
    ("cand_to_vendor", "levels", "num_users", "message"),
    [
        ([0, 2, 1], [[1, 0, 1, 5]], 2, "levels[0][3] = 5 is out of range [0, 2)"),
        ([0, 3, 1], [[1, 0, 1]], 2, "cand_to_user[1] = 3 is out of range [0, 3)"),
        ([0, 2, 1], [[1, 0, 1], [0, 1]], 1, "levels[1][1] = 1 is out of range [0, 1)"),
        ([0, 2, 1], [[1, 0, 1], []], 1, "levels[1] has no entries, but the candidates reach"),
        ([0, 2, 1], [[1, 0, 1.5]], 2, "levels[0] must be a list of ints"),
        ([0, 2, 1], [np.zeros((1, 3), np.int32)], 2, "levels[0] must have 1 dimension"),
    ],
)
def test_candidate_map_from_levels_names_the_level_that_is_wrong(
    cand_to_vendor, levels, num_users, message
):
    with pytest.raises(ValueError) as error:
        ikbo.CandidateMap(np.array(cand_to_vendor, np.int32), num_users, levels=levels)
    assert message in str(error.value)


def test_attention_zero_candidates():
    q = np.zeros((0, 1, 1, 64), dtype=np.float16)
    k = np.ones((2, 3, 1, 64), dtype=np.float16)
    out = ikbo.attention(q, k, k, np.zeros(0, dtype=np.int32))
    assert out.shape == q.shape


def test_attention_workspace_is_none_on_the_cpu():
    q = np.ones((3, 2, 1, 64), dtype=np.float32)
    k = np.ones((1, 4096, 1, 64), dtype=np.float32)
    candidate_map = ikbo.CandidateMap(np.zeros(3, dtype=np.int32), 1)
    assert ikbo._C.attention_workspace_bytes(q, k, k, candidate_map) == 0


def test_keys_scoring_minus_infinity_get_no_weight():
    """Keys of -inf against positive queries score -inf: weight 0, also where
    they fill a user's first K/V blocks; a user whose every key scores -inf
    gets zeros (torch's softmax would give NaN)."""
    rng = np.random.default_rng(30)
    lengths, heads, n_seed, head_dim = (300, 40, 7), 2, 3, 64
    offsets = jagged_offsets(lengths)
    q = np.abs(randn(rng, (9, n_seed, heads, head_dim), np.float32)) + 0.5
    k = randn(rng, (int(offsets[-1]), heads, head_dim), np.float32)
    v = randn(rng, (int(offsets[-1]), heads, head_dim), np.float32)
    k[:200] = -np.inf  # user 0's first 200 keys
    k[offsets[1] : offsets[2]] = -np.inf  # all of user 1's
    k[offsets[2] + 3] = -np.inf  # one of user 2's
    cand_to_user = random_mapping(rng, 9, 3, False)
    out = np.full_like(q, np.nan)
    ikbo.attention(q, k, v, cand_to_user, kv_offsets=offsets, out=out)
    scored = cand_to_user != 1
    assert not scored.all(), "the mapping must give user 1 candidates"
    expected = attention_reference(q[scored], k, v, cand_to_user[scored], offsets)
    assert_close(out[scored], expected, "float32")
    assert not out[~scored].any(), "a user whose keys all score -inf must give zeros"
