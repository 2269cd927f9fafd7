"""Invalid arguments: the library's messages arrive as ValueError, verbatim,
and a preallocated out is never touched when a call fails."""

import re

import numpy as np
import pytest

import ikbo
from reference import assert_close, attention_reference

SENTINEL = 7.0


@pytest.fixture
def lce_inputs():
    rng = np.random.default_rng(5)
    w_c = rng.standard_normal((6, 5)).astype(np.float16)
    w_u = rng.standard_normal((6, 4)).astype(np.float16)
    e_c = rng.standard_normal((3, 5, 2)).astype(np.float16)
    e_u = rng.standard_normal((2, 4, 2)).astype(np.float16)
    cand_to_user = np.array([1, 0, 1], dtype=np.int32)
    out = np.full((3, 6, 2), SENTINEL, dtype=np.float16)
    return w_c, w_u, e_c, e_u, cand_to_user, out


@pytest.fixture
def attention_inputs():
    rng = np.random.default_rng(6)
    q = rng.standard_normal((3, 2, 2, 64)).astype(np.float32)
    k = rng.standard_normal((2, 5, 2, 64)).astype(np.float32)
    v = rng.standard_normal((2, 5, 2, 64)).astype(np.float32)
    cand_to_user = np.array([1, 0, 1], dtype=np.int32)
    out = np.full_like(q, SENTINEL)
    return q, k, v, cand_to_user, out


def expect_untouched(out):
    assert (out == SENTINEL).all(), "out was written by a call that failed"


def test_out_of_range_mapping_message(lce_inputs):
    w_c, w_u, e_c, e_u, _, out = lce_inputs
    with pytest.raises(ValueError) as error:
        ikbo.lce(w_c, w_u, e_c, e_u, np.array([0, 1, 2], dtype=np.int32), out=out)
    assert str(error.value) == "cand_to_user[2] = 2 is out of range [0, 2)"
    expect_untouched(out)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (
            lambda a: a.update(e_c=a["e_c"].astype(np.float32)),
            "e_c must have dtype float16, got float32",
        ),
        (
            lambda a: a.update(e_u=a["e_u"].astype(np.float64)),
            (
                "e_u has dtype float64, which ikbo does not take: e_u must be float16, bfloat16 "
                "or float32"
            ),
        ),
        (
            lambda a: a.update(e_c=a["e_c"][:, :4].copy()),
            "e_c dimension 1 must be 5 (Kc of w_c), got 4 (shape [3, 4, 2])",
        ),
        (
            lambda a: a.update(e_u=a["e_u"][..., :1].copy()),
            "e_u dimension 2 must be 2 (N of e_c), got 1",
        ),
        (
            lambda a: a.update(e_c=a["e_c"][:2].copy()),
            "e_c dimension 0 must be 3 (num_candidates of the candidate map), got 2",
        ),
        (
            lambda a: a.update(e_c=a["e_c"].transpose(0, 2, 1).copy().transpose(0, 2, 1)),
            "e_c must be contiguous (row-major), got strides [10, 1, 5] (in elements) for shape [3, 5, 2]",
        ),
        (lambda a: a.update(e_u=a["e_u"].reshape(2, 4, 2, 1)), "e_u must have 3 dimensions, got 4"),
    ],
    ids=[
        "dtype-mismatch",
        "unsupported-dtype",
        "kc-mismatch",
        "n-mismatch",
        "b-mismatch",
        "strided",
        "rank",
    ],
)
def test_lce_invalid_inputs(lce_inputs, mutate, message):
    w_c, w_u, e_c, e_u, cand_to_user, out = lce_inputs
    arguments = {"e_c": e_c, "e_u": e_u}
    mutate(arguments)
    with pytest.raises(ValueError, match=re.escape(message)):
        ikbo.lce(w_c, w_u, arguments["e_c"], arguments["e_u"], cand_to_user, out=out)
    expect_untouched(out)


def test_lce_invalid_out(lce_inputs):
    w_c, w_u, e_c, e_u, cand_to_user, out = lce_inputs
    wrong_shape = np.full((3, 6, 3), SENTINEL, dtype=np.float16)
    with pytest.raises(
        ValueError, match=re.escape("out must have shape [3, 6, 2] ([B, M, N]), got [3, 6, 3]")
    ):
        ikbo.lce(w_c, w_u, e_c, e_u, cand_to_user, out=wrong_shape)
    expect_untouched(wrong_shape)
    wrong_dtype = np.full((3, 6, 2), SENTINEL, dtype=np.float32)
    with pytest.raises(ValueError, match="out must have dtype float16, got float32"):
        ikbo.lce(w_c, w_u, e_c, e_u, cand_to_user, out=wrong_dtype)
    expect_untouched(wrong_dtype)
    strided = np.full((3, 2, 6), SENTINEL, dtype=np.float16).transpose(0, 2, 1)
    with pytest.raises(ValueError, match=re.escape("out must be contiguous (row-major)")):
        ikbo.lce(w_c, w_u, e_c, e_u, cand_to_user, out=strided)
    expect_untouched(strided)
    read_only = out.copy()
    read_only.setflags(write=False)
    with pytest.raises(ValueError, match="out must be writable, got a read-only numpy array"):
        ikbo.lce(w_c, w_u, e_c, e_u, cand_to_user, out=read_only)
    expect_untouched(read_only)


def test_lce_state_mismatches(lce_inputs):
    w_c, w_u, e_c, e_u, cand_to_user, out = lce_inputs
    plan = ikbo.LcePlan(w_c, w_u)
    candidate_map = ikbo.CandidateMap(cand_to_user, 2)
    with pytest.raises(ValueError, match="w_u must be None when w_c_or_plan is an LcePlan"):
        ikbo.lce(plan, w_u, e_c, e_u, candidate_map, out=out)
    with pytest.raises(ValueError, match="w_u is required"):
        ikbo.lce(w_c, None, e_c, e_u, candidate_map, out=out)
    with pytest.raises(
        ValueError, match="num_users = 3 disagrees with the CandidateMap's num_users = 2"
    ):
        ikbo.lce(plan, None, e_c, e_u, candidate_map, num_users=3, out=out)
    for num_users in (2.0, "2", True):
        with pytest.raises(TypeError, match="num_users must be an int or None, got"):
            ikbo.lce(plan, None, e_c, e_u, cand_to_user, num_users=num_users, out=out)
    # Checked against e_u before the map is built: a map sized by a huge
    # num_users is never allocated.
    for num_users in (4, 2**31 - 1):
        with pytest.raises(
            ValueError,
            match=re.escape(f"num_users = {num_users} disagrees with e_u dimension 0 = 2"),
        ):
            ikbo.lce(plan, None, e_c, e_u, cand_to_user, num_users=num_users, out=out)
    expect_untouched(out)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (
            lambda a: a.update(
                q=a["q"][..., :32].copy(), out=np.full((3, 2, 2, 32), SENTINEL, np.float32)
            ),
            "q dimension 3 (head dim D) must be 64, 128 or 256, got 32",
        ),
        (lambda a: a.update(k=a["k"].astype(np.float16)), "k must have dtype float32, got float16"),
        (
            lambda a: a.update(v=a["v"][:, :4].copy()),
            "v must have shape [2, 5, 2, 64] (the shape of k), got [2, 4, 2, 64]",
        ),
        (
            lambda a: a.update(k=a["k"][:, :, :1].copy(), v=a["v"][:, :, :1].copy()),
            "k dimension 2 must be 2 (H of q), got 1",
        ),
        (
            lambda a: a.update(q=a["q"].transpose(0, 2, 1, 3)),
            "q must be contiguous (row-major), got strides",
        ),
        (lambda a: a.update(k=a["k"].astype(np.int32)), "k must have dtype float32, got int32"),
        (lambda a: a.update(scale=float("inf")), "scale must be finite, got inf"),
        (
            lambda a: a.update(cand_to_user=np.array([0, -1, 1], dtype=np.int32)),
            "cand_to_user[1] = -1 is out of range [0, 2)",
        ),
        (
            lambda a: a.update(
                kv_offsets=np.array([0, 4, 10], dtype=np.int32), k=a["k"][0], v=a["v"][0]
            ),
            "kv_offsets[2] must equal the number of K/V rows 5, got 10",
        ),
    ],
    ids=[
        "head-dim",
        "kv-dtype",
        "v-shape",
        "heads",
        "strided-q",
        "int-k",
        "scale",
        "mapping",
        "offsets",
    ],
)
def test_attention_invalid_inputs(attention_inputs, mutate, message):
    q, k, v, cand_to_user, out = attention_inputs
    arguments = {
        "q": q,
        "k": k,
        "v": v,
        "cand_to_user": cand_to_user,
        "out": out,
        "kv_offsets": None,
        "scale": None,
    }
    mutate(arguments)
    with pytest.raises(ValueError, match=re.escape(message)):
        ikbo.attention(
            arguments["q"],
            arguments["k"],
            arguments["v"],
            arguments["cand_to_user"],
            kv_offsets=arguments["kv_offsets"],
            scale=arguments["scale"],
            out=arguments["out"],
        )
    assert (arguments["out"] == SENTINEL).all(), "out was written by a call that failed"


def test_scalar_where_the_wrappers_read_a_row_count(lce_inputs, attention_inputs):
    """lce and attention read U (or the K/V rows) from e_u or k before the
    library sees them: a 0-d array there is a ValueError naming it and the
    rank expected, not an IndexError."""
    w_c, w_u, e_c, _, cand_to_user, out = lce_inputs
    scalar = np.array(1.0, dtype=np.float16)
    with pytest.raises(ValueError, match=re.escape("e_u must have 3 dimensions, got 0 (shape [])")):
        ikbo.lce(w_c, w_u, e_c, scalar, cand_to_user, out=out)
    expect_untouched(out)
    q, _, _, cand_to_user, out = attention_inputs
    scalar = np.array(1.0, dtype=np.float32)
    with pytest.raises(ValueError, match=re.escape("k must have 4 dimensions, got 0 (shape [])")):
        ikbo.attention(q, scalar, scalar, cand_to_user, out=out)
    with pytest.raises(ValueError, match=re.escape("k must have 3 dimensions, got 0 (shape [])")):
        ikbo.attention(q, scalar, scalar, cand_to_user, kv_offsets=[0, 2, 5], out=out)
    expect_untouched(out)


def test_what_is_no_array_is_a_type_error_naming_the_argument(lce_inputs, attention_inputs):
    w_c, w_u, e_c, _, cand_to_user, out = lce_inputs
    for value in ([[1.0]], None, 1.0):
        with pytest.raises(TypeError, match=r"e_u must be an array \(numpy, or a DLPack tensor"):
            ikbo.lce(w_c, w_u, e_c, value, cand_to_user, out=out)
    expect_untouched(out)
    q, k, v, cand_to_user, out = attention_inputs
    with pytest.raises(TypeError, match="k must be an array"):
        ikbo.attention(q, k.tolist(), v, cand_to_user, out=out)
    expect_untouched(out)
    weight, x_c, x_u = np.ones((3, 5), np.float32), np.ones((3, 2), np.float32), np.ones((2, 3))
    for arguments, name in (
        ((weight.tolist(), x_c, x_u), "weight"),
        ((weight, None, x_u), "x_c"),
        ((weight, x_c, 1.0), "x_u"),
    ):
        with pytest.raises(TypeError, match=f"{name} must be an array"):
            ikbo.linear(*arguments, [0, 1, 1])


def test_scale_must_be_a_real_number(attention_inputs):
    q, k, v, cand_to_user, out = attention_inputs
    for scale in ("0.1", 1j, [0.1], True):
        with pytest.raises(TypeError, match="scale must be a real number or None, got"):
            ikbo.attention(q, k, v, cand_to_user, scale=scale, out=out)
    expect_untouched(out)
    ikbo.attention(q, k, v, cand_to_user, scale=np.float32(0.5), out=out)
    assert_close(out, attention_reference(q, k, v, cand_to_user, scale=0.5), "float32")


def test_a_request_without_users_names_the_user_tensor(lce_inputs, attention_inputs):
    """U is read from e_u, x_u or k; with none of their rows the message
    names that tensor, not a num_users the caller never passed."""
    w_c, w_u, e_c, e_u, cand_to_user, out = lce_inputs
    with pytest.raises(ValueError, match=re.escape("e_u dimension 0 must be at least 1 (U")):
        ikbo.lce(w_c, w_u, e_c, e_u[:0], cand_to_user, out=out)
    expect_untouched(out)
    q, k, v, cand_to_user, out = attention_inputs
    with pytest.raises(ValueError, match=re.escape("k dimension 0 must be at least 1 (U")):
        ikbo.attention(q, k[:0], v[:0], cand_to_user, out=out)
    expect_untouched(out)
    with pytest.raises(ValueError, match=re.escape("x_u dimension 0 must be at least 1 (U")):
        ikbo.linear(
            np.ones((3, 5), np.float32),
            np.ones((3, 2), np.float32),
            np.ones((0, 3), np.float32),
            [0, 0, 0],
        )


def test_linear_names_a_user_feature_count_that_disagrees_with_x_u():
    weight, x_c, x_u = np.ones((3, 5), np.float32), np.ones((3, 2), np.float32), np.ones((2, 3))
    with pytest.raises(
        ValueError, match=re.escape("num_user_features = 2 disagrees with x_u dimension 1 = 3")
    ):
        ikbo.linear(weight, x_c, x_u.astype(np.float32), [0, 1, 1], num_user_features=2)


def test_linear_checks_the_rows_before_it_allocates():
    """Without out, linear sizes its output and workspace from x_c's rows:
    rows the map does not vouch for get the library's message first."""
    # An output for x_c's rows would take 1 TiB.
    weight, x_c = np.ones((2**16, 2), np.float32), np.ones((2**22, 1), np.float32)
    with pytest.raises(ValueError, match=re.escape("x_c dimension 0 must be 3 (num_candidates")):
        ikbo.linear(weight, x_c, np.ones((2, 1), np.float32), [0, 1, 1])


def test_dtype_errors_list_what_the_argument_takes(lce_inputs, attention_inputs):
    w_c, w_u, e_c, e_u, cand_to_user, out = lce_inputs
    with pytest.raises(
        ValueError,
        match=re.escape(
            "cand_to_user has dtype int64, which ikbo does not take: cand_to_user must be int32"
        ),
    ):
        ikbo.lce(w_c, w_u, e_c, e_u, cand_to_user.astype(np.int64), out=out)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "e_c has dtype float64, which ikbo does not take: e_c must be float16, bfloat16 "
            "or float32"
        ),
    ):
        ikbo.lce(w_c, w_u, e_c.astype(np.float64), e_u, cand_to_user, out=out)
    expect_untouched(out)
    q, k, v, cand_to_user, out = attention_inputs
    with pytest.raises(
        ValueError,
        match=re.escape(
            "kv_offsets has dtype uint32, which ikbo does not take: kv_offsets must be int32"
        ),
    ):
        ikbo.attention(
            q, k[0], v[0], cand_to_user, kv_offsets=np.array([0, 2, 5], np.uint32), out=out
        )
    expect_untouched(out)


def misaligned(array):
    """A copy of ``array`` one byte off its element size."""
    buffer = np.zeros(array.nbytes + 1, np.uint8)
    copy = np.ndarray(array.shape, array.dtype, buffer=buffer, offset=1)
    copy[...] = array
    assert not copy.flags.aligned
    return copy


def test_misaligned_arrays_are_refused_with_a_message(lce_inputs):
    w_c, w_u, e_c, e_u, cand_to_user, out = lce_inputs
    with pytest.raises(ValueError, match="e_c must be aligned to its element size, 2 bytes"):
        ikbo.lce(w_c, w_u, misaligned(e_c), e_u, cand_to_user, out=out)
    expect_untouched(out)
    with pytest.raises(ValueError, match="cand_to_user must be aligned to its element size"):
        ikbo.lce(w_c, w_u, e_c, e_u, misaligned(cand_to_user), out=out)
    expect_untouched(out)
    shifted_out = misaligned(out)
    with pytest.raises(ValueError, match="out must be aligned to its element size, 2 bytes"):
        ikbo.lce(w_c, w_u, e_c, e_u, cand_to_user, out=shifted_out)
    expect_untouched(shifted_out)


def test_non_native_byte_order_is_refused_with_a_message(lce_inputs):
    w_c, w_u, e_c, e_u, cand_to_user, out = lce_inputs
    swapped = e_c.astype(e_c.dtype.newbyteorder("S"))
    with pytest.raises(ValueError, match=r"e_c has dtype .f2, of non-native byte order: pass"):
        ikbo.lce(w_c, w_u, swapped, e_u, cand_to_user, out=out)
    expect_untouched(out)


def test_numpy_bfloat16_is_refused_with_a_message(attention_inputs):
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed")
    q, k, v, cand_to_user, out = attention_inputs
    with pytest.raises(
        ValueError,
        match=re.escape(
            "q is a numpy bfloat16 array (ml_dtypes), which numpy cannot export through "
            "DLPack: pass bfloat16 data as a torch tensor, or q as float16 or float32"
        ),
    ):
        ikbo.attention(q.astype(ml_dtypes.bfloat16), k, v, cand_to_user, out=out)
    expect_untouched(out)


def test_attention_out_aliasing_an_input_is_refused(attention_inputs):
    q, k, v, cand_to_user, _ = attention_inputs
    with pytest.raises(ValueError, match="out overlaps q"):
        ikbo.attention(q, k, v, cand_to_user, out=q)


class DLPackOnly:
    """A DLPack producer ikbo knows nothing about (no array namespace)."""

    def __init__(self, array):
        self._array = array
        self.shape = array.shape

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


def test_unknown_dlpack_producer_works_with_out_and_needs_it(attention_inputs):
    q, k, v, cand_to_user, out = attention_inputs
    wrapped = [DLPackOnly(array) for array in (q, k, v)]
    ikbo.attention(*wrapped, cand_to_user, out=out)
    assert_close(out, attention_reference(q, k, v, cand_to_user), "float32")
    with pytest.raises(
        TypeError, match="ikbo cannot allocate an output for inputs of type .*DLPackOnly"
    ):
        ikbo.attention(*wrapped, cand_to_user)
