"""ikbo on torch CPU tensors: bfloat16 (which numpy lacks), outputs allocated
as torch tensors, autograd-tracked inputs, and torch's strided views."""

import re

import numpy as np
import pytest

import ikbo
from reference import assert_close, attention_reference, jagged_offsets, lce_reference

try:
    import torch
except ImportError as error:  # the suite runs on machines without torch too
    pytest.skip(
        f"torch is not importable ({error}); torch CPU tests need it", allow_module_level=True
    )

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def randn(generator, shape, dtype):
    return torch.randn(shape, generator=generator, dtype=torch.float32).to(dtype)


@pytest.mark.parametrize("dtype_name", TORCH_DTYPES)
def test_lce_torch_cpu(dtype_name):
    dtype = TORCH_DTYPES[dtype_name]
    generator = torch.Generator().manual_seed(1)
    m, ku, kc, n, num_candidates = 37, 21, 30, 5, 9
    w_c = randn(generator, (m, kc), dtype) / kc**0.5
    w_u = randn(generator, (m, ku), dtype) / ku**0.5
    e_c = randn(generator, (num_candidates, kc, n), dtype)
    e_u = randn(generator, (4, ku, n), dtype)
    cand_to_user = torch.tensor([3, 0, 0, 2, 3, 3, 0, 2, 0], dtype=torch.int32)  # user 1 has none
    out = ikbo.lce(w_c, w_u, e_c, e_u, cand_to_user)
    assert isinstance(out, torch.Tensor)
    assert out.dtype == dtype and out.device.type == "cpu" and out.shape == (num_candidates, m, n)
    assert_close(out, lce_reference(w_c, w_u, e_c, e_u, cand_to_user), dtype_name)
    poisoned = torch.full_like(out, float("nan"))
    ikbo.lce(w_c, w_u, e_c, e_u, cand_to_user, out=poisoned)
    assert torch.equal(poisoned, out)


@pytest.mark.parametrize("dtype_name", TORCH_DTYPES)
def test_attention_torch_cpu_dense_and_jagged(dtype_name):
    dtype = TORCH_DTYPES[dtype_name]
    generator = torch.Generator().manual_seed(2)
    q = randn(generator, (6, 37, 2, 128), dtype)
    cand_to_user = torch.tensor([1, 0, 2, 1, 1, 0], dtype=torch.int32)
    k = randn(generator, (3, 19, 2, 128), dtype)
    v = randn(generator, (3, 19, 2, 128), dtype)
    dense = ikbo.attention(q, k, v, cand_to_user)
    assert dense.dtype == dtype and dense.shape == q.shape
    assert_close(dense, attention_reference(q, k, v, cand_to_user), dtype_name)

    offsets = jagged_offsets((7, 0, 12))
    k_jagged = randn(generator, (19, 2, 128), dtype)
    v_jagged = randn(generator, (19, 2, 128), dtype)
    out = torch.full_like(q, float("nan"))
    ikbo.attention(
        q, k_jagged, v_jagged, cand_to_user, kv_offsets=torch.from_numpy(offsets), out=out
    )
    assert_close(out, attention_reference(q, k_jagged, v_jagged, cand_to_user, offsets), dtype_name)


def test_inputs_that_require_grad_are_accepted():
    generator = torch.Generator().manual_seed(3)
    w_c = randn(generator, (4, 3), torch.float32).requires_grad_()
    w_u = randn(generator, (4, 2), torch.float32).requires_grad_()
    e_c = randn(generator, (2, 3, 5), torch.float32).requires_grad_()
    e_u = randn(generator, (1, 2, 5), torch.float32)
    cand_to_user = torch.zeros(2, dtype=torch.int32)
    out = ikbo.lce(w_c, w_u, e_c, e_u, cand_to_user)
    assert not out.requires_grad
    assert_close(out, lce_reference(w_c, w_u, e_c, e_u, cand_to_user), "float32")


def test_strided_torch_views_are_refused():
    q = torch.zeros(3, 2, 2, 64, dtype=torch.bfloat16)
    k = torch.zeros(2, 64, 5, 2, dtype=torch.bfloat16).permute(0, 2, 3, 1)
    cand_to_user = torch.tensor([0, 1, 1], dtype=torch.int32)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "k must be contiguous (row-major), got strides [640, 2, 1, 10] (in elements) for shape [2, 5, 2, 64]"
        ),
    ):
        ikbo.attention(q, k, k.contiguous(), cand_to_user)


def test_int64_mapping_is_refused_with_its_dtype():
    with pytest.raises(ValueError, match="cand_to_user has dtype int64"):
        ikbo.CandidateMap(torch.tensor([0, 1]), 2)
    assert ikbo.CandidateMap(torch.tensor([0, 1], dtype=torch.int32), 2).num_candidates == 2


def test_torch_and_numpy_results_agree():
    rng = np.random.default_rng(4)
    q, k, v = (
        rng.standard_normal(shape).astype(np.float16)
        for shape in [(4, 3, 1, 64), (2, 9, 1, 64), (2, 9, 1, 64)]
    )
    cand_to_user = np.array([1, 1, 0, 1], dtype=np.int32)
    from_numpy = ikbo.attention(q, k, v, cand_to_user)
    from_torch = ikbo.attention(*(torch.from_numpy(a) for a in (q, k, v, cand_to_user)))
    np.testing.assert_array_equal(from_torch.numpy(), from_numpy)


def test_sparse_nested_and_quantized_tensors_are_refused_by_name():
    w = torch.ones(4, 3)
    e_c, e_u = torch.ones(2, 3, 5), torch.ones(1, 3, 5)
    cand_to_user = torch.zeros(2, dtype=torch.int32)
    nested = torch.nested.as_nested_tensor([torch.ones(3, 5), torch.ones(3, 5)])
    quantized = torch.quantize_per_tensor(e_c, 0.1, 0, torch.quint8)
    for arguments, message in [
        (
            (w, w, e_c.to_sparse(), e_u, cand_to_user),
            "e_c must be a dense (strided) tensor, got layout",
        ),
        (
            (w, w, e_c, e_u, cand_to_user.to_sparse()),
            "cand_to_user must be a dense (strided) tensor",
        ),
        (
            (w, w, nested, e_u, cand_to_user),
            "e_c must be a dense (strided) tensor, got a nested tensor",
        ),
        (
            (w, w, quantized, e_u, cand_to_user),
            (
                "e_c is a quantized tensor (dtype quint8), which ikbo does not take: e_c must be "
                "float16, bfloat16 or float32"
            ),
        ),
    ]:
        with pytest.raises(ValueError, match="^" + re.escape(message)):
            ikbo.lce(*arguments)
    out = torch.zeros(2, 4, 5).to_sparse()
    with pytest.raises(ValueError, match=r"^out must be a dense \(strided\) tensor"):
        ikbo.lce(w, w, e_c, e_u, cand_to_user, out=out)
    assert out._nnz() == 0


def test_torch_tensors_reach_the_library_as_dlpack_capsules(monkeypatch):
    """Every tensor of an op crosses through torch.utils.dlpack.to_dlpack (C),
    not Tensor.__dlpack__ (Python, ~1.5 µs a tensor): the per-op overhead."""
    exported = []
    to_dlpack = torch.utils.dlpack.to_dlpack

    def counting_to_dlpack(tensor):
        exported.append(tensor)
        return to_dlpack(tensor)

    monkeypatch.setattr(torch.utils.dlpack, "to_dlpack", counting_to_dlpack)
    generator = torch.Generator().manual_seed(5)
    q = randn(generator, (3, 4, 1, 64), torch.float32)
    k = randn(generator, (2, 9, 1, 64), torch.float32)
    v = randn(generator, (2, 9, 1, 64), torch.float32)
    cand_to_user = torch.tensor([1, 0, 1], dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    ikbo.attention(q, k, v, cand_to_user, out=out)
    for tensor in (q, k, v, cand_to_user, out):
        assert any(seen is tensor for seen in exported)
    assert_close(out, attention_reference(q, k, v, cand_to_user), "float32")
