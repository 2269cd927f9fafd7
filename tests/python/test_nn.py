"""ikbo.nn: layers holding torch's parameters that take user tensors at U
rows, against the torch layers on replicated inputs."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not importable; ikbo.nn needs it")
from torch._dynamo.testing import CompileCounter

# After torch's check; a failing import of ikbo's own modules must fail.
import ikbo.nn
from reference import requires_torch_cuda

F = torch.nn.functional
# Users 1 and 4 have no candidates; the mapping is unsorted.
COUNTS = (3, 0, 5, 1, 0, 2)
DEVICES = [
    ("cpu", torch.float32, 1e-5),
    # Both sides round to float16 after each layer, not always alike.
    pytest.param("cuda", torch.float16, 4e-3, marks=requires_torch_cuda(torch)),
]


def mapping(device, counts=COUNTS, seed=0):
    generator = torch.Generator().manual_seed(seed)
    index = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    return index[torch.randperm(len(index), generator=generator)].to(device)


def randn(device, dtype, *shape):
    return torch.randn(shape).to(device, dtype)


@pytest.mark.parametrize(("device", "dtype", "tolerance"), DEVICES)
def test_lce_is_the_matmul_over_the_replicated_concat(device, dtype, tolerance):
    torch.manual_seed(0)
    layer = ikbo.nn.LCE(7, 5, 9, device=device, dtype=dtype)
    assert layer.weight.shape == (9, 12)
    cand_to_user = mapping(device)
    e_u, e_c = randn(device, dtype, 6, 7, 16), randn(device, dtype, len(cand_to_user), 5, 16)
    with torch.no_grad():
        got = layer(e_u, e_c, cand_to_user)
        want = torch.matmul(layer.weight, torch.cat([e_u[cand_to_user], e_c], 1))
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(("device", "dtype", "tolerance"), DEVICES)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_is_nn_linear_over_the_replicated_concat(device, dtype, tolerance, bias):
    torch.manual_seed(0)
    layer = ikbo.nn.Linear(6, 10, 8, bias, device=device, dtype=dtype)
    reference = torch.nn.Linear(16, 8, bias, device=device, dtype=dtype)
    reference.load_state_dict(layer.state_dict())  # nn.Linear's names and shapes
    cand_to_user = mapping(device)
    x_u, x_c = randn(device, dtype, 6, 6), randn(device, dtype, len(cand_to_user), 10)
    with torch.no_grad():
        want = reference(torch.cat([x_u[cand_to_user], x_c], -1))
        torch.testing.assert_close(
            layer(x_u, x_c, cand_to_user), want, rtol=tolerance, atol=tolerance
        )
        shared = ikbo.nn.Linear.from_linear(reference, 6)
        assert shared.weight is reference.weight and shared.bias is reference.bias
        torch.testing.assert_close(
            shared(x_u, x_c, cand_to_user), want, rtol=tolerance, atol=tolerance
        )


ATTENTION_SHAPES = {
    "packed": {"embed_dim": 128, "num_heads": 2},
    "kdim_vdim": {"embed_dim": 256, "num_heads": 2, "kdim": 48, "vdim": 40},
    "no_bias": {"embed_dim": 256, "num_heads": 4, "bias": False},
}


def torch_attention(layer, query, keys, values, cand_to_user):
    """What the torch layer gives on K/V replicated to the candidates."""
    out, weights = layer(query, keys[cand_to_user], values[cand_to_user], need_weights=False)
    assert weights is None
    return out


@pytest.mark.parametrize(("device", "dtype", "tolerance"), DEVICES)
@pytest.mark.parametrize("shape", ATTENTION_SHAPES)
def test_multihead_attention_is_torch_s_on_replicated_keys_and_values(
    device, dtype, tolerance, shape
):
    options = ATTENTION_SHAPES[shape]
    torch.manual_seed(0)
    layer = ikbo.nn.MultiheadAttention(**options, device=device, dtype=dtype)
    reference = torch.nn.MultiheadAttention(**options, batch_first=True, device=device, dtype=dtype)
    reference.load_state_dict(layer.state_dict())
    assert layer.state_dict().keys() == reference.state_dict().keys()
    cand_to_user = mapping(device)
    kdim, vdim = options.get("kdim") or options["embed_dim"], options.get("vdim")
    query = randn(device, dtype, len(cand_to_user), 4, options["embed_dim"])
    keys = randn(device, dtype, 6, 33, kdim)
    values = randn(device, dtype, 6, 33, vdim or options["embed_dim"])
    with torch.no_grad():
        want = torch_attention(reference.eval(), query, keys, values, cand_to_user)
        got = layer(query, keys, values, cand_to_user)
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
        shared = ikbo.nn.MultiheadAttention.from_torch(reference)
        assert shared.out_proj is reference.out_proj
        assert dict(shared.named_parameters()).keys() == dict(reference.named_parameters()).keys()
        torch.testing.assert_close(
            shared(query, keys, values, cand_to_user), want, rtol=tolerance, atol=tolerance
        )


@pytest.mark.parametrize(("device", "dtype", "tolerance"), DEVICES)
def test_multihead_attention_on_jagged_histories(device, dtype, tolerance):
    """Rows of each user's own length; a user without rows gets the output
    projection's bias."""
    torch.manual_seed(0)
    layer = ikbo.nn.MultiheadAttention(128, 2, device=device, dtype=dtype).eval()
    lengths = [5, 0, 17, 1, 9, 30]
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)
    cand_to_user = mapping(device, counts=(2, 3, 1, 4, 1, 2))
    query = randn(device, dtype, len(cand_to_user), 3, 128)
    keys, values = randn(device, dtype, sum(lengths), 128), randn(device, dtype, sum(lengths), 128)
    reference = torch.nn.MultiheadAttention(128, 2, batch_first=True, device=device, dtype=dtype)
    reference.load_state_dict(layer.state_dict())
    with torch.no_grad():
        got = layer(query, keys, values, cand_to_user, offsets)
        for b, user in enumerate(cand_to_user.tolist()):
            rows = slice(offsets[user], offsets[user + 1])
            if lengths[user] == 0:
                want = layer.out_proj.bias.expand(3, 128)
            else:
                want, _ = reference(
                    query[b : b + 1], keys[None, rows], values[None, rows], need_weights=False
                )
                want = want[0]
            torch.testing.assert_close(got[b], want, rtol=tolerance, atol=tolerance)


class Model(torch.nn.Module):
    """The three layers in a row: LCE, seeds attending to the history, an MLP input."""

    def __init__(self):
        super().__init__()
        self.lce = ikbo.nn.LCE(4, 3, 8)
        self.attention = ikbo.nn.MultiheadAttention(64, 1, kdim=8, vdim=8)
        self.linear = ikbo.nn.Linear(5, 2 * 64, 1)

    def forward(self, e_u, e_c, history, x_u, cand_to_user):
        compressed = self.lce(e_u, e_c, cand_to_user)  # [B, 8, 8]
        seeds = compressed.flatten(1)[:, None, :].expand(-1, 2, -1)  # [B, 2, 64]
        attended = self.attention(seeds, history, history, cand_to_user).mean(1)
        features = torch.cat([compressed.flatten(1), attended], -1)
        return self.linear(x_u, features, cand_to_user)


def model_request(counts):
    cand_to_user = mapping("cpu", counts)
    users, candidates = len(counts), len(cand_to_user)
    return (
        torch.randn(users, 4, 8),
        torch.randn(candidates, 3, 8),
        torch.randn(users, 11, 8),
        torch.randn(users, 5),
        cand_to_user,
    )


@pytest.mark.parametrize(("device", "dtype", "tolerance"), DEVICES)
def test_layers_take_the_levels_of_a_multi_level_request(device, dtype, tolerance):
    """Candidates -> vendors -> users: ``levels=[vendor_to_user]`` with the
    candidates' vendor ids equals the layers on the composed mapping."""
    torch.manual_seed(0)
    vendor_to_user = mapping(device, counts=(2, 0, 3, 1, 1, 2), seed=1)  # 9 vendors, 6 users
    cand_to_vendor = mapping(device, counts=(1, 3, 0, 2, 1, 1, 4, 1, 2), seed=2)
    composed = vendor_to_user[cand_to_vendor]
    levels = [vendor_to_user]
    lce = ikbo.nn.LCE(7, 5, 9, device=device, dtype=dtype)
    linear = ikbo.nn.Linear(6, 10, 8, device=device, dtype=dtype)
    attention = ikbo.nn.MultiheadAttention(128, 2, device=device, dtype=dtype)
    e_u, e_c = randn(device, dtype, 6, 7, 16), randn(device, dtype, len(composed), 5, 16)
    x_u, x_c = randn(device, dtype, 6, 6), randn(device, dtype, len(composed), 10)
    query, history = randn(device, dtype, len(composed), 4, 128), randn(device, dtype, 6, 33, 128)
    with torch.no_grad():
        pairs = (
            (lce(e_u, e_c, cand_to_vendor, levels), lce(e_u, e_c, composed)),
            (linear(x_u, x_c, cand_to_vendor, levels), linear(x_u, x_c, composed)),
            (
                attention(query, history, history, cand_to_vendor, levels=levels),
                attention(query, history, history, composed),
            ),
        )
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


class LevelledAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = ikbo.nn.MultiheadAttention(128, 2)

    def forward(self, query, history, cand_to_vendor, vendor_to_user):
        return self.attention(query, history, history, cand_to_vendor, levels=[vendor_to_user])


def test_levels_trace_into_compiled_and_exported_graphs():
    torch.manual_seed(1)
    model = LevelledAttention().eval()
    inputs = (
        randn("cpu", torch.float32, 5, 3, 128),
        randn("cpu", torch.float32, 2, 7, 128),
        torch.tensor([0, 2, 1, 1, 0]),
        torch.tensor([1, 0, 1]),
    )
    with torch.no_grad():
        want = model(*inputs)
        exported = torch.export.export(model, inputs).module()
        compiled = torch.compile(model, fullgraph=True, dynamic=True)
        for got in (exported(*inputs), compiled(*inputs)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_layers_compile_into_one_graph_over_request_sizes():
    torch.manual_seed(0)
    model = Model().eval()
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    # No B or U of 1 or equal to a layer width: dynamo would specialize it
    # or give it the width's symbol.
    for counts in ((2, 1, 3, 1, 2, 1), (1, 2) * 3 + (1,), (3, 1, 1, 2, 1, 1, 2, 1, 1)):
        inputs = model_request(counts)
        with torch.no_grad():
            torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1


def test_layers_export():
    torch.manual_seed(0)
    model = Model().eval()
    exported = torch.export.export(model, model_request((2, 1, 3))).module()
    inputs = model_request((3, 1, 2))  # same sizes: export fixed them
    with torch.no_grad():
        torch.testing.assert_close(exported(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)


def test_invalid_layers_and_calls_are_refused_by_name():
    with pytest.raises(ValueError, match="compressed_embeddings must be a positive int, got 0"):
        ikbo.nn.LCE(3, 4, 0)
    with pytest.raises(ValueError, match="embed_dim / num_heads must be 64, 128 or 256"):
        ikbo.nn.MultiheadAttention(96, 2)
    with pytest.raises(ValueError, match="user_features must be an int in \\[1, 7\\)"):
        ikbo.nn.Linear.from_linear(torch.nn.Linear(7, 2), 7)
    with pytest.raises(ValueError, match="add_bias_kv or add_zero_attn"):
        ikbo.nn.MultiheadAttention.from_torch(torch.nn.MultiheadAttention(64, 1, add_bias_kv=True))
    with pytest.raises(TypeError, match="must be an nn.MultiheadAttention"):
        ikbo.nn.MultiheadAttention.from_torch(torch.nn.Linear(64, 64))
    layer = ikbo.nn.LCE(3, 4, 5)
    with torch.no_grad(), pytest.raises(ValueError, match="e_u"):
        layer(torch.randn(2, 4, 8), torch.randn(3, 4, 8), torch.tensor([0, 1, 1]))
