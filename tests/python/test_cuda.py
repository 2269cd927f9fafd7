"""ikbo on CUDA through torch (and cupy when installed): correctness against
float64 references, the caller's current stream, device checks, and CUDA
graph capture (the ops neither allocate nor synchronize)."""

import gc
import json
import os
import re
import time
import weakref

import numpy as np
import pytest

import ikbo
from reference import TOLERANCE, assert_close, element_bound, jagged_offsets, lce_reference

try:
    import torch
except ImportError as error:
    pytest.skip(f"no CUDA device: torch is not importable ({error})", allow_module_level=True)
if not ikbo.built_with_cuda():
    pytest.skip("no CUDA device: this ikbo build has no CUDA backend", allow_module_level=True)
if not torch.cuda.is_available() or ikbo.cuda_device_count() == 0:
    pytest.skip(
        f"no CUDA device: torch.cuda.is_available() = {torch.cuda.is_available()}, "
        f"ikbo.cuda_device_count() = {ikbo.cuda_device_count()}",
        allow_module_level=True,
    )

DEVICE = torch.device("cuda", 0)
TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def randn(generator, shape, dtype, scale=1.0):
    values = torch.randn(shape, generator=generator, device=DEVICE, dtype=torch.float32) * scale
    return values.to(dtype)


def lce_reference_cuda(w_c, w_u, e_c, e_u, cand_to_user):
    """float64 on the GPU, the user term computed once per user then gathered."""
    user_part = w_u.double() @ e_u.double()
    return w_c.double() @ e_c.double() + user_part[cand_to_user.long()]


def assert_close_cuda(actual, expected, dtype_name):
    assert actual.device == expected.device and actual.shape == expected.shape
    values = actual.double()
    assert torch.isfinite(values).all(), (
        "output has non-finite entries (NaN poison not overwritten?)"
    )
    error = (
        torch.linalg.vector_norm(values - expected) / torch.linalg.vector_norm(expected)
    ).item()
    tolerance = TOLERANCE[dtype_name]
    assert error <= tolerance, f"relative Frobenius error {error:.3g} > {tolerance}"
    outside = (values - expected).abs() > element_bound(expected, tolerance)
    assert not outside.any(), f"{int(outside.sum())} elements outside t * (|e| + 8 rms)"


def lce_inputs(dtype, m, ku, kc, n, num_candidates, num_users, seed):
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    w_c = randn(generator, (m, kc), dtype, kc**-0.5)
    w_u = randn(generator, (m, ku), dtype, ku**-0.5)
    e_c = randn(generator, (num_candidates, kc, n), dtype)
    e_u = randn(generator, (num_users, ku, n), dtype)
    cand_to_user = torch.randint(
        0, num_users, (num_candidates,), generator=generator, device=DEVICE, dtype=torch.int32
    )
    return w_c, w_u, e_c, e_u, cand_to_user


@pytest.mark.parametrize("dtype_name", TORCH_DTYPES)
def test_lce_reference_shape(dtype_name):
    # The published reference: M=433, N=256, Ku=1178, Kc=866, B=1024, U=15.
    inputs = lce_inputs(TORCH_DTYPES[dtype_name], 433, 1178, 866, 256, 1024, 15, seed=1)
    # Into a NaN-poisoned out: an element left unwritten fails the check (an
    # allocated out could hold the caching allocator's stale, finite values).
    poisoned = torch.full((1024, 433, 256), float("nan"), dtype=inputs[0].dtype, device=DEVICE)
    assert ikbo.lce(*inputs, out=poisoned) is poisoned
    assert_close_cuda(poisoned, lce_reference_cuda(*inputs), dtype_name)
    out = ikbo.lce(*inputs)
    assert out.device == DEVICE and out.dtype == TORCH_DTYPES[dtype_name]
    assert torch.equal(out, poisoned), "an allocated out must get the same bits"


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize(
    "shape",
    [(5, 3, 4, 1, 1, 1), (17, 9, 13, 5, 11, 6), (8, 1, 1, 7, 40, 2)],
    ids=["single", "odd", "k-of-one"],
)
def test_lce_small_odd_shapes_into_poisoned_out(dtype_name, shape):
    w_c, w_u, e_c, e_u, cand_to_user = lce_inputs(TORCH_DTYPES[dtype_name], *shape, seed=2)
    out = torch.full(
        (e_c.shape[0], w_c.shape[0], e_c.shape[2]),
        float("nan"),
        dtype=TORCH_DTYPES[dtype_name],
        device=DEVICE,
    )
    ikbo.lce(w_c, w_u, e_c, e_u, cand_to_user, out=out)
    assert_close_cuda(out, lce_reference_cuda(w_c, w_u, e_c, e_u, cand_to_user), dtype_name)


def test_fused_lce_baseline_matches_the_reference_or_says_why_not():
    # The Python bench's "fused" stage: on Hopper it runs into a poisoned
    # out; elsewhere the blocker names the reason and the call refuses.
    dtype = torch.float16
    w_c, w_u, e_c, e_u, cand_to_user = lce_inputs(dtype, 433, 1025, 872, 256, 9, 4, seed=3)
    plan = ikbo.LcePlan(w_c, w_u)
    candidate_map = ikbo.CandidateMap(cand_to_user, e_u.shape[0])
    out = torch.full((9, 433, 256), float("nan"), dtype=dtype, device=DEVICE)
    workspace_bytes = ikbo._C.lce_workspace_bytes(plan, e_c, e_u, candidate_map)
    workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=DEVICE)
    reason = ikbo._C.baseline.lce_fused_blocker(plan, e_c, e_u, candidate_map, out, workspace)
    stream = torch.cuda.current_stream(DEVICE).cuda_stream
    hopper = torch.cuda.get_device_capability(DEVICE) == (9, 0)
    if hopper and not os.environ.get("IKBO_DISABLE_SM90"):
        assert reason is None or "no sm_90a code" in reason, reason
    if reason is not None:
        with pytest.raises(RuntimeError, match="lce_fused: the"):
            ikbo._C.baseline.lce_fused(plan, e_c, e_u, candidate_map, out, stream, workspace)
        assert torch.isnan(out).all()
        return
    ikbo._C.baseline.lce_fused(plan, e_c, e_u, candidate_map, out, stream, workspace)
    assert_close_cuda(out, lce_reference_cuda(w_c, w_u, e_c, e_u, cand_to_user), "float16")


def attention_reference_cuda(q, k, v, cand_to_user, offsets=None, scale=None):
    """float64 on the GPU, one user at a time (all of its candidates at once)."""
    q64, k64, v64 = q.double(), k.double(), v.double()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.zeros_like(q64)
    mapping = cand_to_user.long()
    num_users = k.shape[0] if offsets is None else len(offsets) - 1
    for user in range(num_users):
        candidates = torch.nonzero(mapping == user).flatten()
        if offsets is None:
            keys, values = k64[user], v64[user]
        else:
            keys, values = (
                k64[offsets[user] : offsets[user + 1]],
                v64[offsets[user] : offsets[user + 1]],
            )
        if candidates.numel() == 0 or keys.shape[0] == 0:
            continue
        scores = scale * torch.einsum("bshd,thd->bhst", q64[candidates], keys)
        out[candidates] = torch.einsum("bhst,thd->bshd", torch.softmax(scores, dim=-1), values)
    return out


@pytest.mark.parametrize("dtype_name", TORCH_DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_dense_attention(dtype_name, head_dim):
    # Reference-like: ratio 64/65, H=2, n_seed=64, odd S.
    dtype = TORCH_DTYPES[dtype_name]
    generator = torch.Generator(device=DEVICE).manual_seed(3)
    num_users, seq_len = 3, 500
    counts = torch.tensor([64, 65, 64])
    cand_to_user = torch.repeat_interleave(torch.arange(num_users), counts).to(DEVICE, torch.int32)
    q = randn(generator, (int(counts.sum()), 64, 2, head_dim), dtype)
    k = randn(generator, (num_users, seq_len, 2, head_dim), dtype)
    v = randn(generator, (num_users, seq_len, 2, head_dim), dtype)
    poisoned = torch.full_like(q, float("nan"))
    assert ikbo.attention(q, k, v, cand_to_user, out=poisoned) is poisoned
    assert_close_cuda(poisoned, attention_reference_cuda(q, k, v, cand_to_user), dtype_name)
    out = ikbo.attention(q, k, v, cand_to_user)
    assert out.device == DEVICE and out.dtype == dtype
    assert torch.equal(out, poisoned), "an allocated out must get the same bits"


@pytest.mark.parametrize("dtype_name", TORCH_DTYPES)
def test_jagged_attention_unsorted_with_empty_histories(dtype_name):
    dtype = TORCH_DTYPES[dtype_name]
    generator = torch.Generator(device=DEVICE).manual_seed(4)
    lengths = (0, 5, 130, 1, 0)
    offsets = jagged_offsets(lengths)
    total = int(offsets[-1])
    cand_to_user = torch.tensor([2, 0, 4, 2, 1, 3, 2, 0, 1], dtype=torch.int32, device=DEVICE)
    q = randn(generator, (9, 37, 1, 128), dtype)
    k = randn(generator, (total, 1, 128), dtype)
    v = randn(generator, (total, 1, 128), dtype)
    out = torch.full_like(q, float("nan"))
    ikbo.attention(
        q, k, v, cand_to_user, kv_offsets=torch.from_numpy(offsets).to(DEVICE), scale=0.05, out=out
    )
    expected = attention_reference_cuda(q, k, v, cand_to_user, offsets.tolist(), scale=0.05)
    assert_close_cuda(out, expected, dtype_name)
    empty = (cand_to_user == 0) | (cand_to_user == 4)
    assert (out[empty] == 0).all(), "a user without history must give zeros"


@pytest.mark.parametrize("jagged", [False, True])
def test_attention_of_few_query_tiles_splits_keys_on_hopper(jagged):
    # One user, 8 candidates x 64 seeds x 2 heads: 8 query tiles (and the
    # user's spare slots) for a whole GPU, so on Hopper GPUs ikbo.attention
    # asks for a workspace and splits the 2048-4096 keys across CTAs.
    dtype = torch.float16
    generator = torch.Generator(device=DEVICE).manual_seed(5)
    cand_to_user = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    q = randn(generator, (8, 64, 2, 128), dtype)
    offsets = jagged_offsets((3000,)) if jagged else None
    shape = (3000, 2, 128) if jagged else (1, 4096, 2, 128)
    k, v = randn(generator, shape, dtype), randn(generator, shape, dtype)
    kv_offsets = torch.from_numpy(offsets).to(DEVICE) if jagged else None
    candidate_map = ikbo.CandidateMap(cand_to_user, 1)
    state = ikbo.JaggedOffsets(kv_offsets, k.shape[0]) if jagged else None
    workspace_bytes = ikbo._C.attention_workspace_bytes(q, k, v, candidate_map, state)
    if torch.cuda.get_device_capability(DEVICE) == (9, 0):
        assert workspace_bytes > 0, "a call of few query tiles must split its keys on Hopper"
    out = torch.full_like(q, float("nan"))
    ikbo.attention(q, k, v, candidate_map, kv_offsets=state, out=out)
    again = ikbo.attention(q, k, v, candidate_map, kv_offsets=state)
    expected = attention_reference_cuda(q, k, v, cand_to_user, offsets.tolist() if jagged else None)
    assert_close_cuda(out, expected, "float16")
    assert torch.equal(out, again), "two runs on identical inputs differ"


def test_candidate_map_on_cuda():
    cand_to_user = torch.tensor([2, 0, 2, 2], dtype=torch.int32, device=DEVICE)
    candidate_map = ikbo.CandidateMap(cand_to_user, 3)
    assert candidate_map.device == "cuda:0"
    np.testing.assert_array_equal(candidate_map.user_counts, [1, 0, 3])
    with pytest.raises(ValueError) as error:
        ikbo.CandidateMap(torch.tensor([0, 5], dtype=torch.int32, device=DEVICE), 3)
    assert str(error.value) == "cand_to_user[1] = 5 is out of range [0, 3)"


def test_candidate_maps_compose_on_cuda():
    to_vendor = ikbo.CandidateMap(torch.tensor([3, 1, 3, 0], dtype=torch.int32, device=DEVICE), 4)
    vendor_to_user = ikbo.CandidateMap(
        torch.tensor([2, 0, 2, 1], dtype=torch.int32, device=DEVICE), 3
    )
    composed = ikbo.CandidateMap.compose(to_vendor, vendor_to_user)
    assert composed.device == "cuda:0"
    np.testing.assert_array_equal(composed.cand_to_user, [1, 0, 1, 2])
    on_host = ikbo.CandidateMap(np.array([0, 1, 1, 2], dtype=np.int32), 3)
    with pytest.raises(ValueError) as error:
        ikbo.CandidateMap.compose(to_vendor, on_host)
    assert str(error.value) == (
        "to_group and group_to_user must be on one device, got cuda:0 and cpu"
    )
    # From the index tensors: the same map, its device copy built once.
    from_levels = ikbo.CandidateMap(
        torch.tensor([3, 1, 3, 0], dtype=torch.int32, device=DEVICE),
        3,
        levels=[torch.tensor([2, 0, 2, 1], dtype=torch.int32, device=DEVICE)],
    )
    assert from_levels.device == "cuda:0"
    np.testing.assert_array_equal(from_levels.cand_to_user, [1, 0, 1, 2])
    with pytest.raises(ValueError) as error:
        ikbo.CandidateMap(
            torch.tensor([3, 1, 3, 0], dtype=torch.int32, device=DEVICE),
            3,
            levels=[np.array([2, 0, 2, 1], dtype=np.int32)],
        )
    assert str(error.value) == "levels[0] must be on cuda:0 like cand_to_user, got cpu"


def test_maps_and_offsets_built_into_the_callers_storage():
    """With storage, the device copy lives in the caller's buffer (here from
    torch's allocator), which the object keeps alive; ops read it as they
    read the object's own copy, and unusable storage is refused by name."""
    generator = torch.Generator(device=DEVICE).manual_seed(46)
    cand_to_user = torch.tensor([2, 0, 1, 0, 2, 2, 1], dtype=torch.int32, device=DEVICE)
    offsets = torch.tensor([0, 5, 5, 12], dtype=torch.int32, device=DEVICE)
    q = randn(generator, (7, 3, 2, 64), torch.float16)
    k, v = (randn(generator, (12, 2, 64), torch.float16) for _ in range(2))
    map_bytes = ikbo.CandidateMap.device_bytes(7, 3)
    storage = torch.empty(map_bytes, dtype=torch.uint8, device=DEVICE)
    kept = weakref.ref(storage)
    built = ikbo.CandidateMap(cand_to_user, 3, storage=storage)
    offsets_storage = torch.empty(
        ikbo.JaggedOffsets.device_bytes(3), dtype=torch.uint8, device=DEVICE
    )
    jagged = ikbo.JaggedOffsets(offsets, 12, storage=offsets_storage)
    # cand_to_user, user_offsets, candidates_by_user, back to back.
    np.testing.assert_array_equal(
        storage.view(torch.int32).cpu(),
        np.concatenate([built.cand_to_user, built.user_offsets, built.candidates_by_user]),
    )
    assert torch.equal(offsets_storage.view(torch.int32), offsets)
    del storage
    gc.collect()
    assert kept() is not None, "the map must keep its storage alive"
    out = ikbo.attention(q, k, v, built, kv_offsets=jagged)
    expected = ikbo.attention(
        q, k, v, ikbo.CandidateMap(cand_to_user, 3), kv_offsets=ikbo.JaggedOffsets(offsets, 12)
    )
    assert torch.equal(out, expected)
    del built
    gc.collect()
    assert kept() is None, "dropping the map releases its storage"
    composed_storage = torch.empty(map_bytes, dtype=torch.uint8, device=DEVICE)
    composed = ikbo.CandidateMap.compose(
        ikbo.CandidateMap(cand_to_user, 3),
        ikbo.CandidateMap(torch.tensor([1, 0, 2], dtype=torch.int32, device=DEVICE), 3),
        storage=composed_storage,
    )
    np.testing.assert_array_equal(
        composed_storage.view(torch.int32)[:7].cpu(), composed.cand_to_user
    )

    too_small = torch.empty(map_bytes - 4, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError) as error:
        ikbo.CandidateMap(cand_to_user, 3, storage=too_small)
    assert str(error.value) == (
        f"storage must hold {map_bytes} bytes (see CandidateMap::device_bytes), "
        f"got {map_bytes - 4} bytes"
    )
    with pytest.raises(ValueError, match=re.escape("storage must be 256-byte aligned")):
        ikbo.CandidateMap(
            cand_to_user,
            3,
            storage=torch.empty(2 * map_bytes, dtype=torch.uint8, device=DEVICE)[4:],
        )
    with pytest.raises(ValueError) as error:
        ikbo.JaggedOffsets(offsets, 12, storage=np.zeros(64, dtype=np.uint8))
    assert str(error.value) == "storage must be on cuda:0 like kv_offsets, got cpu"


def test_ops_build_a_mapping_into_torch_memory():
    """An op given a mapping or offsets tensor (not a prebuilt object) builds
    it into memory from torch's caching allocator: one torch allocation more
    per object than the same call with prebuilt objects."""
    generator = torch.Generator(device=DEVICE).manual_seed(47)
    w_c, w_u, e_c, e_u, cand_to_user = lce_inputs(torch.float16, 9, 7, 5, 16, 6, 3, seed=47)
    plan, built = ikbo.LcePlan(w_c, w_u), ikbo.CandidateMap(cand_to_user, 3)
    out = torch.empty((6, 9, 16), dtype=torch.float16, device=DEVICE)
    q = randn(generator, (6, 2, 2, 64), torch.float16)
    k, v = (randn(generator, (10, 2, 64), torch.float16) for _ in range(2))
    offsets = torch.tensor([0, 4, 4, 10], dtype=torch.int32, device=DEVICE)
    jagged = ikbo.JaggedOffsets(offsets, 10)
    attention_out = torch.empty_like(q)

    def allocations(call) -> int:
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        call()
        return torch.cuda.memory_stats()["allocation.all.allocated"] - before

    prebuilt = allocations(lambda: ikbo.lce(plan, None, e_c, e_u, built, out=out))
    assert allocations(lambda: ikbo.lce(plan, None, e_c, e_u, cand_to_user, out=out)) == (
        prebuilt + 1
    )
    prebuilt = allocations(
        lambda: ikbo.attention(q, k, v, built, kv_offsets=jagged, out=attention_out)
    )
    assert allocations(
        lambda: ikbo.attention(q, k, v, cand_to_user, kv_offsets=offsets, out=attention_out)
    ) == (prebuilt + 2)


def test_runs_on_the_current_stream():
    """ikbo launches on torch's current stream: queued on a side stream behind
    a GPU sleep, the output is still unwritten when the default stream reads
    it, and right once the side stream has run."""
    inputs = lce_inputs(torch.float16, 64, 96, 80, 32, 256, 4, seed=5)
    plan = ikbo.LcePlan(inputs[0], inputs[1])
    candidate_map = ikbo.CandidateMap(inputs[4], 4)
    expected = lce_reference_cuda(*inputs)
    out = torch.full(expected.shape, float("nan"), dtype=torch.float16, device=DEVICE)
    side_stream = torch.cuda.Stream()
    side_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side_stream):
        torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU clock cycles
        ikbo.lce(plan, None, inputs[2], inputs[3], candidate_map, out=out)
    assert out.isnan().all().item(), "ikbo ran before the side stream's sleep ended"
    torch.cuda.current_stream().wait_stream(side_stream)
    assert_close_cuda(out, expected, "float16")


def test_the_stream_handed_to_the_library_is_torchs_current_one():
    """ikbo.ops reads torch's current stream through its raw handle: the same
    cudaStream_t as torch.cuda.current_stream() on the default stream and
    inside a stream context."""
    from ikbo.ops import _current_stream

    tensor = torch.zeros(1, device=DEVICE)
    assert _current_stream(tensor) == torch.cuda.current_stream(DEVICE).cuda_stream
    side_stream = torch.cuda.Stream()
    with torch.cuda.stream(side_stream):
        assert _current_stream(tensor) == side_stream.cuda_stream != 0
    assert _current_stream(tensor.cpu()) == 0


def test_device_mismatches_leave_out_untouched():
    w_c, w_u, e_c, e_u, cand_to_user = lce_inputs(torch.float16, 8, 5, 6, 3, 4, 2, seed=6)
    out = torch.full((4, 8, 3), 7.0, dtype=torch.float16, device=DEVICE)
    cpu_map = ikbo.CandidateMap(cand_to_user.cpu(), 2)
    with pytest.raises(
        ValueError, match=re.escape("the candidate map must be on cuda:0 like the weights, got cpu")
    ):
        ikbo.lce(w_c, w_u, e_c, e_u, cpu_map, out=out)
    with pytest.raises(ValueError, match=re.escape("e_c must be on cuda:0, got cpu")):
        ikbo.lce(w_c, w_u, e_c.cpu(), e_u, cand_to_user, out=out)
    with pytest.raises(ValueError, match=re.escape("out must be on cuda:0, got cpu")):
        ikbo.lce(w_c, w_u, e_c, e_u, cand_to_user, out=out.cpu())
    assert (out == 7.0).all()
    plan = ikbo.LcePlan(w_c, w_u)
    candidate_map = ikbo.CandidateMap(cand_to_user, 2)
    needed = ikbo._C.lce_workspace_bytes(plan, e_c, e_u, candidate_map)
    # Every CUDA LCE call asks for one: the cuBLAS path's scratch at least.
    assert needed > 0
    too_small = torch.empty(needed - 1, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match=f"workspace must hold {needed} bytes"):
        ikbo._C.lce(
            plan,
            e_c,
            e_u,
            candidate_map,
            out,
            torch.cuda.current_stream().cuda_stream,
            too_small,
        )
    with pytest.raises(ValueError, match="workspace must be on cuda:0 like the plan, got cpu"):
        ikbo._C.lce(plan, e_c, e_u, candidate_map, out, 0, torch.empty(needed, dtype=torch.uint8))
    assert (out == 7.0).all()


def test_cuda_graph_capture_and_replay():
    w_c, w_u, e_c, e_u, cand_to_user = lce_inputs(torch.float16, 33, 40, 24, 16, 70, 3, seed=7)
    plan = ikbo.LcePlan(w_c, w_u)
    candidate_map = ikbo.CandidateMap(cand_to_user, 3)
    lce_out = torch.empty(70, 33, 16, dtype=torch.float16, device=DEVICE)
    generator = torch.Generator(device=DEVICE).manual_seed(8)
    q = randn(generator, (70, 4, 2, 64), torch.float16)
    k = randn(generator, (3, 50, 2, 64), torch.float16)
    v = randn(generator, (3, 50, 2, 64), torch.float16)
    attention_out = torch.empty_like(q)

    def step():
        ikbo.lce(plan, None, e_c, e_u, candidate_map, out=lce_out)
        ikbo.attention(q, k, v, candidate_map, out=attention_out)

    warmup = torch.cuda.Stream()
    warmup.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warmup):
        step()
    torch.cuda.current_stream().wait_stream(warmup)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    generator = torch.Generator(device=DEVICE).manual_seed(7)
    e_c.copy_(randn(generator, e_c.shape, e_c.dtype))
    q.copy_(randn(generator, q.shape, q.dtype))
    lce_out.fill_(float("nan"))
    attention_out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_close_cuda(lce_out, lce_reference_cuda(w_c, w_u, e_c, e_u, cand_to_user), "float16")
    assert_close_cuda(attention_out, attention_reference_cuda(q, k, v, cand_to_user), "float16")


def test_cupy_arrays():
    cupy = pytest.importorskip("cupy", reason="cupy is not installed")
    rng = np.random.default_rng(9)
    host = [
        rng.standard_normal(shape).astype(np.float16)
        for shape in [(12, 7), (12, 5), (6, 7, 3), (2, 5, 3)]
    ]
    cand_to_user = np.array([1, 0, 1, 1, 0, 0], dtype=np.int32)
    w_c, w_u, e_c, e_u = (cupy.asarray(array) for array in host)
    out = ikbo.lce(w_c, w_u, e_c, e_u, cupy.asarray(cand_to_user))
    assert isinstance(out, cupy.ndarray) and out.dtype == np.float16
    cupy.cuda.get_current_stream().synchronize()
    assert_close(cupy.asnumpy(out), lce_reference(*host, cand_to_user), "float16")


def busy_wait(seconds):
    """Keeps the host busy (not asleep) for ``seconds``."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass


def test_bench_timer_times_the_gpu_not_the_host():
    """A run whose host side takes 60 us before it launches a ~5 us kernel:
    each run waits behind the timer's GPU lead, so the events see the
    kernel, not the host's time (without the lead they would span the busy
    wait, less what the L2 flush before it overlaps)."""
    from ikbo import bench

    timer = bench.Timer(DEVICE, reps=7, warmup=2, settle_ms=0)
    a = torch.ones(1024, device=DEVICE)

    def slow_host_small_kernel():
        busy_wait(60e-6)
        a.add_(1.0)

    assert timer.median_ms(slow_host_small_kernel) < 0.03


def test_bench_timer_outlasts_a_pause_of_the_host():
    """One run's host side pauses for 3 ms (as when the interpreter hands the
    GIL to another thread) before a ~5 us kernel: the GPU's head start keeps
    the queue from draining, so no run times the pause."""
    from ikbo import bench

    timer = bench.Timer(DEVICE, reps=7, warmup=2, settle_ms=0)
    a = torch.ones(1024, device=DEVICE)
    calls = 0

    def one_pause():
        nonlocal calls
        calls += 1
        if calls == 5:  # the third timed run
            busy_wait(3e-3)
        a.add_(1.0)

    assert timer.spread_ms(one_pause).max < 0.03


def test_bench_timer_samples_the_sm_clock():
    from ikbo import bench

    timer = bench.Timer(DEVICE, reps=3, warmup=1, settle_ms=50)
    a = torch.ones(2048, 2048, device=DEVICE, dtype=torch.float16)
    assert len(timer.samples_ms(lambda: a @ a)) == 3
    if timer.clock_sampling.startswith("SM clock not sampled"):
        pytest.skip(timer.clock_sampling)
    assert "at most 50 ms" in timer.clock_sampling
    clocks = timer.last_clocks
    assert 0 < clocks["min_sm_mhz"] <= clocks["sm_mhz"]
    assert set(clocks["clock_limits"]) <= {name for _, name in bench._CLOCK_LIMITS}
    # The idle before the runs stops at its bound (plus one poll and the call).
    assert 0 <= clocks["settled_ms"] <= 50 + 1e3 * bench.ClockMonitor.SETTLE_PERIOD_S + 20


def test_bench_lce_suite_times_the_fused_stage_or_says_why_not(tmp_path):
    from ikbo import bench

    path = tmp_path / "lce.json"
    arguments = ["lce", "--device", "cuda", "--B", "24", "--ratio", "4"]
    arguments += ["--lce-dims", "40,16,24,40", "--reps", "2", "--warmup", "0", "--settle-ms", "0"]
    assert bench.main([*arguments, "--json", str(path)]) == 0
    document = json.loads(path.read_text())
    variants = [record["variant"] for record in document["records"]]
    skipped = {item["variant"]: item for item in document["not_measured"]}
    assert "ikbo" in variants and ("fused" in variants) != ("fused" in skipped)
    if "fused" in skipped:
        assert skipped["fused"]["outcome"] == "skipped" and skipped["fused"]["reason"]
    else:
        assert variants.index("fused") == variants.index("ikbo") - 1
