"""CandidateMap, JaggedOffsets and LcePlan from Python: derived arrays,
properties, and the library's validation messages arriving as ValueError."""

import ast
import pathlib
import re

import numpy as np
import pytest

import ikbo


def test_build_info():
    assert isinstance(ikbo.built_with_cuda(), bool)
    assert isinstance(ikbo.cuda_device_count(), int)
    assert ikbo.cuda_device_count() >= 0
    if not ikbo.built_with_cuda():
        assert ikbo.cuda_device_count() == 0
    assert re.fullmatch(r"\d+\.\d+\.\d+", ikbo.__version__)


def test_package_carries_type_information():
    """PEP 561: the py.typed marker, and a stub of the extension that names
    every public member of ikbo._C but the benchmark baselines."""
    package = pathlib.Path(ikbo.__file__).parent
    assert (package / "py.typed").is_file()
    stub = ast.parse((package / "_C.pyi").read_text())
    names = set()
    for node in stub.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(target.id for target in node.targets if isinstance(target, ast.Name))
    public = {name for name in dir(ikbo._C) if not name.startswith("_")} - {"baseline"}
    assert public | {"__version__"} == names


def test_candidate_map_derives_groups_of_an_unsorted_mapping():
    cand_to_user = np.array([2, 0, 4, 0, 2, 2], dtype=np.int32)
    candidate_map = ikbo.CandidateMap(cand_to_user, 5)
    assert candidate_map.num_candidates == 6
    assert candidate_map.num_users == 5
    assert candidate_map.device == "cpu"
    assert not candidate_map.is_sorted
    assert candidate_map.max_count == 3
    np.testing.assert_array_equal(candidate_map.cand_to_user, cand_to_user)
    np.testing.assert_array_equal(candidate_map.user_counts, [2, 0, 3, 0, 1])
    np.testing.assert_array_equal(candidate_map.user_offsets, [0, 2, 2, 5, 5, 6])
    # Stable grouping: within a user, candidates keep their original order.
    np.testing.assert_array_equal(candidate_map.candidates_by_user, [1, 3, 0, 4, 5, 2])
    assert candidate_map.user_offsets.dtype == np.int32
    assert "num_candidates=6" in repr(candidate_map)


def test_candidate_map_compose_follows_both_levels():
    """Candidates -> vendors (vendor 4 has none) -> users (user 3 has no
    vendor), both unsorted."""
    to_vendor = ikbo.CandidateMap(np.array([3, 1, 3, 0, 2], dtype=np.int32), 5)
    vendor_to_user = ikbo.CandidateMap(np.array([2, 0, 2, 1, 0], dtype=np.int32), 4)
    composed = ikbo.CandidateMap.compose(to_vendor, vendor_to_user)
    np.testing.assert_array_equal(composed.cand_to_user, [1, 0, 1, 2, 2])
    assert composed.num_users == 4 and composed.num_candidates == 5
    np.testing.assert_array_equal(composed.user_counts, [1, 2, 2, 0])
    with pytest.raises(ValueError) as error:
        ikbo.CandidateMap.compose(vendor_to_user, to_vendor)
    assert str(error.value) == (
        "group_to_user must map the 4 groups of to_group (its num_candidates), got "
        "num_candidates = 5"
    )


def test_candidate_map_arrays_are_read_only_views_that_outlive_the_expression():
    offsets = ikbo.CandidateMap(np.array([0, 0, 1], dtype=np.int32), 2).user_offsets
    assert not offsets.flags.writeable
    with pytest.raises(ValueError):
        offsets[0] = 7
    np.testing.assert_array_equal(offsets, [0, 2, 3])


def test_candidate_map_sorted_and_empty():
    sorted_map = ikbo.CandidateMap(np.array([0, 0, 1, 3], dtype=np.int32), 4)
    assert sorted_map.is_sorted
    empty = ikbo.CandidateMap(np.zeros(0, dtype=np.int32), 3)
    assert empty.num_candidates == 0
    assert empty.max_count == 0
    assert empty.candidates_by_user.shape == (0,)
    np.testing.assert_array_equal(empty.user_offsets, [0, 0, 0, 0])


def test_candidate_map_accepts_read_only_input():
    cand_to_user = np.array([1, 0], dtype=np.int32)
    cand_to_user.setflags(write=False)
    assert ikbo.CandidateMap(cand_to_user, 2).num_candidates == 2


@pytest.mark.parametrize("bad_value", [3, -1])
def test_candidate_map_out_of_range_message(bad_value):
    cand_to_user = np.array([0, bad_value, 1], dtype=np.int32)
    with pytest.raises(ValueError) as error:
        ikbo.CandidateMap(cand_to_user, 3)
    assert str(error.value) == f"cand_to_user[1] = {bad_value} is out of range [0, 3)"


def test_candidate_map_rejects_wrong_dtype_rank_and_strides():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "cand_to_user has dtype int64, which ikbo does not take: cand_to_user must be int32"
        ),
    ):
        ikbo.CandidateMap(np.array([0, 1], dtype=np.int64), 2)
    with pytest.raises(ValueError, match="cand_to_user must have dtype int32, got float32"):
        ikbo.CandidateMap(np.array([0, 1], dtype=np.float32), 2)
    with pytest.raises(ValueError, match="cand_to_user must have 1 dimension"):
        ikbo.CandidateMap(np.zeros((2, 2), dtype=np.int32), 2)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "cand_to_user must be contiguous (row-major), got strides [2] (in elements) for shape [3]"
        ),
    ):
        ikbo.CandidateMap(np.arange(6, dtype=np.int32)[::2], 6)
    with pytest.raises(ValueError, match=re.escape("num_users must be in [1, ")):
        ikbo.CandidateMap(np.zeros(2, dtype=np.int32), 0)


def test_jagged_offsets_properties_and_validation():
    offsets = ikbo.JaggedOffsets(np.array([0, 0, 3, 5], dtype=np.int32), 5)
    assert (offsets.num_users, offsets.total_rows, offsets.max_length) == (3, 5, 3)
    assert offsets.device == "cpu"
    np.testing.assert_array_equal(offsets.offsets, [0, 0, 3, 5])
    with pytest.raises(ValueError, match=re.escape("kv_offsets[0] must be 0, got 1")):
        ikbo.JaggedOffsets(np.array([1, 3], dtype=np.int32), 3)
    with pytest.raises(ValueError, match="kv_offsets must be non-decreasing"):
        ikbo.JaggedOffsets(np.array([0, 4, 2], dtype=np.int32), 2)
    with pytest.raises(
        ValueError, match=re.escape("kv_offsets[2] must equal the number of K/V rows 9, got 5")
    ):
        ikbo.JaggedOffsets(np.array([0, 2, 5], dtype=np.int32), 9)


def test_storage_sizes_and_a_cpu_object_refuses_storage():
    """device_bytes() is the size of a CUDA object's device copy; a CPU map or
    offsets object has none and refuses storage by name."""
    assert ikbo.CandidateMap.device_bytes(6, 3) == (6 + 6 + 4) * 4
    assert ikbo.JaggedOffsets.device_bytes(3) == 4 * 4
    with pytest.raises(ValueError, match=re.escape("num_users must be in [1, ")):
        ikbo.CandidateMap.device_bytes(6, 0)
    storage = np.zeros(256, dtype=np.uint8)
    message = "storage must be empty for a {} on cpu, which has no device arrays, got 256 bytes"
    with pytest.raises(ValueError, match=re.escape(message.format("CandidateMap"))):
        ikbo.CandidateMap([0, 1, 1], 2, storage=storage)
    with pytest.raises(ValueError, match=re.escape(message.format("CandidateMap"))):
        ikbo.CandidateMap.compose(
            ikbo.CandidateMap([0, 1], 2), ikbo.CandidateMap([1, 0], 2), storage=storage
        )
    with pytest.raises(ValueError, match=re.escape(message.format("JaggedOffsets"))):
        ikbo.JaggedOffsets([0, 1, 3], 3, storage=storage)
    assert ikbo.CandidateMap([0, 1, 1], 2, storage=None).num_candidates == 3


def test_state_takes_lists_of_ints_like_the_ops():
    from_list = ikbo.CandidateMap([2, 0, 2], 3)
    np.testing.assert_array_equal(from_list.cand_to_user, [2, 0, 2])
    np.testing.assert_array_equal(from_list.user_counts, [1, 0, 2])
    assert ikbo.CandidateMap((0, 1), 2).num_candidates == 2
    assert ikbo.CandidateMap([], 2).num_candidates == 0
    offsets = ikbo.JaggedOffsets([0, 0, 3, 5], 5)
    np.testing.assert_array_equal(offsets.offsets, [0, 0, 3, 5])
    assert ikbo.JaggedOffsets((0, 4), 4).max_length == 4
    # The library validates them like arrays.
    with pytest.raises(ValueError, match=re.escape("cand_to_user[1] = 3 is out of range [0, 3)")):
        ikbo.CandidateMap([0, 3], 3)
    with pytest.raises(ValueError, match=re.escape("kv_offsets[0] must be 0, got 1")):
        ikbo.JaggedOffsets([1, 3], 3)


@pytest.mark.parametrize(
    "values, message",
    [
        ([0, 1.5], "cand_to_user must be a list of ints, got elements numpy reads as float64"),
        ([0, 2**32], "cand_to_user holds 4294967296, outside the int32 range"),
        ([-(2**31) - 1, 0], "cand_to_user holds -2147483649, outside the int32 range"),
    ],
)
def test_lists_are_read_as_given_not_cast(values, message):
    """A list is checked before it becomes int32: a cast would make 1.5 a 1
    and 2^32 a 0 without a word."""
    with pytest.raises(ValueError, match=re.escape(message)):
        ikbo.CandidateMap(values, 2)


@pytest.mark.parametrize(
    "value, given",
    [("01", "str"), (None, "NoneType"), (np.array(["0", "1"]), "ndarray of dtype <U1")],
)
def test_state_from_neither_tensor_nor_list_names_the_argument(value, given):
    with pytest.raises(
        ValueError,
        match=re.escape(
            "cand_to_user must be an int32 tensor (numpy, torch, ... through DLPack) or a list "
            f"of ints, got {given}"
        ),
    ):
        ikbo.CandidateMap(value, 2)
    with pytest.raises(ValueError, match=re.escape("kv_offsets must be an int32 tensor")):
        ikbo.JaggedOffsets(value, 2)


def test_lce_plan_properties_and_validation():
    w_c = np.ones((7, 5), dtype=np.float16)
    w_u = np.ones((7, 3), dtype=np.float16)
    plan = ikbo.LcePlan(w_c, w_u)
    assert (plan.m, plan.ku, plan.kc) == (7, 3, 5)
    assert plan.dtype == "float16"
    assert plan.device == "cpu"
    assert "m=7" in repr(plan)
    with pytest.raises(ValueError, match=re.escape("w_u dimension 0 must be 7 (M of w_c), got 6")):
        ikbo.LcePlan(w_c, np.ones((6, 3), dtype=np.float16))
    with pytest.raises(ValueError, match="w_u must have dtype float16, got float32"):
        ikbo.LcePlan(w_c, np.ones((7, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="w_c has dtype float64, which ikbo does not take"):
        ikbo.LcePlan(np.ones((7, 5)), np.ones((7, 3)))
    with pytest.raises(ValueError, match=re.escape("w_c must be contiguous (row-major)")):
        ikbo.LcePlan(np.ones((5, 7), dtype=np.float16).T, w_u)


def test_plan_keeps_its_own_copy_of_the_weights():
    rng = np.random.default_rng(3)
    w_c = rng.standard_normal((4, 3)).astype(np.float32)
    w_u = rng.standard_normal((4, 2)).astype(np.float32)
    e_c = rng.standard_normal((2, 3, 5)).astype(np.float32)
    e_u = rng.standard_normal((1, 2, 5)).astype(np.float32)
    cand_to_user = np.zeros(2, dtype=np.int32)
    plan = ikbo.LcePlan(w_c, w_u)
    expected = ikbo.lce(plan, None, e_c, e_u, cand_to_user)
    w_c[:] = np.nan
    del w_u
    np.testing.assert_array_equal(ikbo.lce(plan, None, e_c, e_u, cand_to_user), expected)
