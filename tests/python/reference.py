"""float64 numpy references for the ikbo ops, and the helpers the tests share.

The references compute from the inputs as stored (already rounded to their
dtype), so the only error measured is the op's own: fp32 accumulation and the
final rounding to the output dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Relative Frobenius error allowed per output dtype.
TOLERANCE = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-5}


def as_float64(array) -> np.ndarray:
    """numpy float64 copy of a numpy array or a torch tensor (any device, bf16 too)."""
    if isinstance(array, np.ndarray):
        return array.astype(np.float64)
    return array.detach().to("cpu").double().numpy()


def relative_error(actual, expected: np.ndarray) -> float:
    actual = as_float64(actual)
    scale = np.linalg.norm(expected)
    difference = np.linalg.norm(actual - expected)
    return float(difference / scale) if scale > 0 else float(difference)


def element_bound(expected, tolerance: float):
    """Each element's allowed error, ``t * (|e| + 8 rms(e))`` (as the C++ tests'
    matches_reference): the Frobenius norm alone would pass a few wrong
    elements among many right ones, while rounding stays within ``t |e|``."""
    count = expected.numel() if hasattr(expected, "numel") else expected.size  # torch, numpy
    rms = (expected**2).mean() ** 0.5 if count else 0.0
    return tolerance * (abs(expected) + 8 * rms)


def assert_close(actual, expected: np.ndarray, dtype_name: str) -> None:
    values = as_float64(actual)
    assert values.shape == expected.shape
    assert np.isfinite(values).all(), "output has non-finite entries (NaN poison not overwritten?)"
    error = relative_error(values, expected)
    tolerance = TOLERANCE[dtype_name]
    assert error <= tolerance, f"relative Frobenius error {error:.3g} > {tolerance}"
    outside = np.abs(values - expected) > element_bound(expected, tolerance)
    assert not outside.any(), (
        f"{int(outside.sum())} elements outside t * (|e| + 8 rms), the first at "
        f"{np.argwhere(outside)[0].tolist()}"
    )


def random_mapping(
    rng: np.random.Generator,
    num_candidates: int,
    num_users: int,
    sort: bool = True,
    empty_users: Sequence[int] = (),
) -> np.ndarray:
    """int32 cand_to_user [B] over [0, num_users), skipping `empty_users`;
    every other user gets at least one candidate when B allows."""
    users = np.array([u for u in range(num_users) if u not in set(empty_users)], dtype=np.int32)
    mapping = np.concatenate(
        [
            users[: min(len(users), num_candidates)],
            rng.choice(users, size=max(0, num_candidates - len(users))),
        ]
    )
    mapping = np.sort(mapping) if sort else rng.permutation(mapping)
    return mapping.astype(np.int32)


def lce_reference(w_c, w_u, e_c, e_u, cand_to_user) -> np.ndarray:
    """out[b] = w_c @ e_c[b] + w_u @ e_u[cand_to_user[b]], in float64."""
    mapping = np.asarray(as_float64(cand_to_user), dtype=np.int64)
    return as_float64(w_c) @ as_float64(e_c) + as_float64(w_u) @ as_float64(e_u)[mapping]


def attention_reference(
    q, k, v, cand_to_user, kv_offsets: np.ndarray | None = None, scale: float | None = None
) -> np.ndarray:
    """Per-candidate softmax attention onto its user's K/V, in float64.
    Dense k, v [U, S, H, D]; jagged k, v [total, H, D] with kv_offsets [U + 1]."""
    q, k, v = as_float64(q), as_float64(k), as_float64(v)
    mapping = np.asarray(as_float64(cand_to_user), dtype=np.int64)
    head_dim = q.shape[-1]
    scale = 1.0 / np.sqrt(head_dim) if scale is None else scale
    out = np.zeros_like(q)
    for candidate, user in enumerate(mapping):
        if kv_offsets is None:
            keys, values = k[user], v[user]
        else:
            begin, end = int(kv_offsets[user]), int(kv_offsets[user + 1])
            keys, values = k[begin:end], v[begin:end]
        if keys.shape[0] == 0:
            continue
        scores = scale * np.einsum("shd,thd->hst", q[candidate], keys)
        scores -= scores.max(axis=-1, keepdims=True)
        weights = np.exp(scores)
        weights /= weights.sum(axis=-1, keepdims=True)
        out[candidate] = np.einsum("hst,thd->shd", weights, values)
    return out


def jagged_offsets(lengths: Sequence[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def requires_torch_cuda(torch):
    """A pytest mark that skips a test, saying why, unless torch tensors can
    run on ikbo's CUDA backend here."""
    import pytest

    import ikbo

    state = (
        f"torch.cuda.is_available() = {torch.cuda.is_available()}, "
        f"ikbo.built_with_cuda() = {ikbo.built_with_cuda()}, "
        f"ikbo.cuda_device_count() = {ikbo.cuda_device_count()}"
    )
    usable = torch.cuda.is_available() and ikbo.built_with_cuda() and ikbo.cuda_device_count() > 0
    return pytest.mark.skipif(not usable, reason=f"no CUDA device ({state})")
