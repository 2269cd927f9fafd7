"""ikbo.rewrite: finding user tensors broadcast to the candidates in fx graphs
(symbolic_trace, torch.export, torch.compile), replacing their LCE, linear
and attention consumers with ikbo ops, checking the result on sample inputs,
and reporting what was left and why."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not importable; the rewrite pass needs it")
rewrite = pytest.importorskip("ikbo.rewrite")
torch_ops = pytest.importorskip("ikbo.torch_ops")
F = torch.nn.functional

NUM_USERS, KU, KC, N, M = 3, 6, 10, 8, 5
COUNTS = (2, 4, 1)  # candidates per user, sorted mapping
NUM_CANDIDATES = sum(COUNTS)


def request(seed=0, dtype=torch.float32, counts=COUNTS):
    """Inputs of one request: user tensors at U rows, candidate tensors at B."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=generator).to(dtype)

    num_candidates = sum(counts)
    cand_to_user = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    return {
        "e_u": randn(len(counts), KU, N),
        "e_c": randn(num_candidates, KC, N),
        "x_u": randn(len(counts), 4),
        "x_c": randn(num_candidates, 3),
        "q": randn(num_candidates, 2, 16, 64),  # SDPA layout [B, H, L, D]
        "k_u": randn(len(counts), 2, 12, 64),
        "v_u": randn(len(counts), 2, 12, 64),
        "cand_to_user": cand_to_user,
    }


class RankingModel(torch.nn.Module):
    """The replicate-then-compute style ikbo replaces: every user-side
    tensor is gathered to the candidates before its interaction layer."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        generator = torch.Generator().manual_seed(100)
        self.compression = torch.nn.Parameter(
            (torch.randn(M, KU + KC, generator=generator) / 4).to(dtype)
        )
        self.projection = torch.nn.Linear(4 + 3, 6).to(dtype)

    def forward(self, e_u, e_c, x_u, x_c, q, k_u, v_u, cand_to_user):
        embeddings = torch.cat([torch.index_select(e_u, 0, cand_to_user), e_c], dim=1)
        compressed = torch.matmul(self.compression, embeddings)
        projected = self.projection(torch.cat([x_u[cand_to_user], x_c], dim=-1))
        attended = F.scaled_dot_product_attention(q, k_u[cand_to_user], v_u[cand_to_user])
        return compressed.flatten(1), projected, attended


def ikbo_ops(module):
    return sorted(
        str(node.target) for node in module.graph.nodes if str(node.target).startswith("ikbo.")
    )


def assert_same_outputs(rewritten, original, inputs, tolerance=1e-5):
    with torch.no_grad():
        for got, want in zip(rewritten(*inputs), original(*inputs)):
            torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


EXPECTED_OPS = ["ikbo.attention.default", "ikbo.lce.default", "ikbo.linear.default"]


def test_symbolic_trace_graph(capsys):
    model, inputs = RankingModel().eval(), tuple(request().values())
    rewritten = rewrite.optimize(model, inputs)
    report = rewritten.ikbo_report
    assert report.tracer == "symbolic_trace" and report.max_error < 1e-5 and not report.left
    assert sorted(item.op for item in report.rewritten) == [
        "ikbo::attention",
        "ikbo::lce",
        "ikbo::linear",
    ]
    assert ikbo_ops(rewritten) == EXPECTED_OPS
    gathers = [node for node in rewritten.graph.nodes if node.target in (torch.index_select,)]
    assert not gathers
    printed = capsys.readouterr().out
    assert "3 rewritten, 0 broadcast(s) left" in printed
    assert "rewrote matmul -> ikbo::lce" in printed and "Ku=6 user / Kc=10" in printed
    # The rewritten graph is not specialized to the sample request.
    assert_same_outputs(rewritten, model, tuple(request(seed=1, counts=(1, 5, 3, 2)).values()))


def test_export_graph():
    model, inputs = RankingModel().eval(), tuple(request().values())
    rewritten = rewrite.optimize(torch.export.export(model, inputs), inputs, verbose=False)
    assert rewritten.ikbo_report.tracer == "torch.export"
    assert ikbo_ops(rewritten) == EXPECTED_OPS
    targets = {str(node.target) for node in rewritten.graph.nodes}
    assert "aten.index.Tensor" not in targets and "aten.index_select.default" not in targets
    assert_same_outputs(rewritten, model, tuple(request(seed=2).values()))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_models(dtype):
    model, inputs = RankingModel(dtype).eval(), tuple(request(dtype=dtype).values())
    rewritten = rewrite.optimize(model, inputs, verbose=False)
    assert len(rewritten.ikbo_report.rewritten) == 3


def test_map_built_once_per_request_by_the_rewritten_model():
    model = RankingModel().eval()
    rewritten = rewrite.optimize(model, tuple(request().values()), verbose=False)
    inputs = tuple(request(seed=3).values())
    with torch.no_grad():
        rewritten(*inputs)
        before = torch_ops.build_counts()
        rewritten(*tuple(request(seed=4).values()))
    after = torch_ops.build_counts()
    assert after["CandidateMap"] == before["CandidateMap"] + 1
    assert after["LcePlan"] == before["LcePlan"] and after["LinearPlan"] == before["LinearPlan"]


class Spellings(torch.nn.Module):
    """LCE over a user tensor broadcast in one of the recognized spellings."""

    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling
        self.weight = torch.nn.Parameter(torch.randn(M, KU + KC) / 4)

    def forward(self, e_u, e_c, counts):
        num_users, num_candidates = e_u.shape[0], e_c.shape[0]
        if self.spelling == "index_select":
            gathered = e_u.index_select(0, torch.repeat_interleave(counts))
        elif self.spelling == "getitem":
            gathered = e_u[torch.repeat_interleave(counts), :]
        elif self.spelling == "repeat_interleave_counts":
            gathered = torch.repeat_interleave(e_u, counts, dim=0)
        elif self.spelling == "repeat_interleave_int":
            gathered = e_u.repeat_interleave(num_candidates // num_users, dim=0)
        elif self.spelling == "unsqueeze_expand_reshape":
            ratio = num_candidates // num_users
            gathered = e_u.unsqueeze(1).expand(-1, ratio, -1, -1).reshape(-1, KU, N)
        else:  # one user, expanded
            gathered = e_u[:1].expand(num_candidates, -1, -1)
        weight = self.weight.expand(num_candidates, -1, -1)
        return torch.bmm(weight, torch.cat([gathered, e_c], dim=1))


@pytest.mark.parametrize(
    "spelling",
    [
        "index_select",
        "getitem",
        "repeat_interleave_counts",
        "repeat_interleave_int",
        "unsqueeze_expand_reshape",
        "expand_one_user",
    ],
)
def test_broadcast_spellings(spelling):
    counts = (3, 3, 3)
    inputs = request(counts=counts)
    arguments = (inputs["e_u"], inputs["e_c"], torch.tensor(counts))
    model = Spellings(spelling)
    rewritten = rewrite.optimize(model, arguments, verbose=False)
    assert ikbo_ops(rewritten) == ["ikbo.lce.default"], rewritten.ikbo_report
    assert not rewritten.ikbo_report.left
    assert_same_outputs(rewritten, model, arguments)


class AttentionLayouts(torch.nn.Module):
    """K/V gathered in ikbo's [U, S, H, D] layout then transposed for SDPA,
    or transposed then gathered; q arrives as [B, L, H, D] too."""

    def forward(self, q, k_u, v_u, cand_to_user):
        keys = k_u[cand_to_user].transpose(1, 2)
        values = v_u.transpose(1, 2).index_select(0, cand_to_user)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, scale=0.2)
        return out.transpose(1, 2)


def test_attention_layouts_cancel_transposes():
    inputs = request()
    q = inputs["q"].transpose(1, 2).contiguous()
    k_u, v_u = (inputs[name].transpose(1, 2).contiguous() for name in ("k_u", "v_u"))
    arguments = (q, k_u, v_u, inputs["cand_to_user"])
    rewritten = rewrite.optimize(AttentionLayouts(), arguments, verbose=False)
    assert ikbo_ops(rewritten) == ["ikbo.attention.default"]
    (attention,) = [n for n in rewritten.graph.nodes if str(n.target) == "ikbo.attention.default"]
    # q and K are passed as they are; only V, gathered after its transpose, is swapped back.
    assert attention.args[0].name == "q" and attention.args[1].name == "k_u"
    assert attention.args[5] == 0.2
    assert_same_outputs(rewritten, AttentionLayouts(), arguments)


class Unsupported(torch.nn.Module):
    def forward(self, q, k_u, v_u, cand_to_user, e_u, x_u):
        causal = F.scaled_dot_product_attention(
            q, k_u[cand_to_user], v_u[cand_to_user], is_causal=True
        )
        small_heads = F.scaled_dot_product_attention(
            q[..., :32], k_u[cand_to_user][..., :32], v_u[cand_to_user][..., :32]
        )
        per_user_only = torch.relu(e_u[cand_to_user])
        user_features = x_u[cand_to_user]
        return (
            causal,
            small_heads,
            per_user_only,
            F.linear(torch.cat([user_features, user_features], -1), torch.ones(2, 8)),
        )


def test_report_says_what_was_left_and_why(capsys):
    inputs = request()
    arguments = tuple(inputs[name] for name in ("q", "k_u", "v_u", "cand_to_user", "e_u", "x_u"))
    rewritten = rewrite.optimize(Unsupported(), arguments)
    report = rewritten.ikbo_report
    assert not report.rewritten
    reasons = " | ".join(item.reason for item in report.left)
    assert "SDPA is causal" in reasons
    assert "used by getitem" in reasons  # the [..., :32] slices are not SDPA operands
    assert "used by relu" in reasons
    assert "every operand of cat is per-user" in reasons
    assert "left getitem" in capsys.readouterr().out


class NegativeIndices(torch.nn.Module):
    """x[idx] reads idx = -1 as the last user; ikbo refuses indices outside [0, U)."""

    def __init__(self):
        super().__init__()
        self.projection = torch.nn.Linear(4 + 3, 6)

    def forward(self, e_u, e_c, x_u, x_c, weight, cand_to_user):
        compressed = weight @ torch.cat([e_u[cand_to_user], e_c], dim=1)
        return compressed, self.projection(torch.cat([x_u[cand_to_user], x_c], dim=-1))


def test_rewrites_that_change_results_are_dropped():
    inputs = request()
    weight = torch.randn(M, KU + KC)
    arguments = (
        inputs["e_u"],
        inputs["e_c"],
        inputs["x_u"],
        inputs["x_c"],
        weight,
        inputs["cand_to_user"] - NUM_USERS,
    )
    model = NegativeIndices()
    rewritten = rewrite.optimize(model, arguments, verbose=False)
    report = rewritten.ikbo_report
    assert not report.rewritten and not ikbo_ops(rewritten)
    assert len(report.left) == 2
    for item in report.left:
        assert "was dropped: the rewritten graph raised ValueError" in item.reason
        assert "cand_to_user" in item.reason  # the library's own message
    assert_same_outputs(rewritten, model, arguments)


def test_weights_given_as_graph_inputs():
    def linear_over_concat(x_u, x_c, weight, bias, cand_to_user):
        return F.linear(torch.cat([x_c, x_u[cand_to_user]], dim=1), weight, bias)

    inputs = request()
    weight, bias = torch.randn(6, 7), torch.randn(6)
    arguments = (inputs["x_u"], inputs["x_c"], weight, bias, inputs["cand_to_user"])
    rewritten = rewrite.optimize(
        torch.fx.symbolic_trace(linear_over_concat), arguments, verbose=False
    )
    assert ikbo_ops(rewritten) == ["ikbo.linear.default"]
    assert "Ku=4 user / Kc=3" in rewritten.ikbo_report.rewritten[0].detail
    assert_same_outputs(rewritten, linear_over_concat, arguments)


def test_torch_compile_backend(capsys):
    model, inputs = RankingModel().eval(), tuple(request().values())
    compiled = torch.compile(model, backend=rewrite.backend, fullgraph=True)
    with torch.no_grad():
        outputs = compiled(*inputs)
    assert "3 rewritten, 0 broadcast(s) left" in capsys.readouterr().out
    with torch.no_grad():
        for got, want in zip(outputs, model(*inputs)):
            torch.testing.assert_close(got, want)


def test_backend_hands_the_result_to_another_compiler():
    model, inputs = RankingModel().eval(), tuple(request().values())
    compiled = torch.compile(model, backend=rewrite.make_backend("aot_eager", verbose=False))
    assert_same_outputs(compiled, model, inputs)
