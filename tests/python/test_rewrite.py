"""ikbo.rewrite: finding user tensors broadcast to the candidates in fx graphs
(symbolic_trace, torch.export, torch.compile), replacing their LCE, linear
and attention consumers with ikbo ops, checking the result on sample inputs,
and reporting what was left and why."""

import re
import warnings

import pytest

torch = pytest.importorskip("torch", reason="torch is not importable; the rewrite pass needs it")
from torch.fx.passes.shape_prop import ShapeProp

# After torch's check; a failing import of ikbo's own modules must fail.
from ikbo import rewrite, torch_ops
from reference import requires_torch_cuda

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
    # The rewritten graph is not specialized to the sample request, and a
    # user without candidates is no special case.
    assert_same_outputs(rewritten, model, tuple(request(seed=1, counts=(1, 5, 3, 2)).values()))
    assert_same_outputs(rewritten, model, tuple(request(seed=5, counts=(2, 0, 3)).values()))


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
    # On a new request too, within the half type's rounding of O(1) outputs.
    assert_same_outputs(rewritten, model, tuple(request(seed=6, dtype=dtype).values()), 3e-2)


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
        generator = torch.Generator().manual_seed(101)
        self.weight = torch.nn.Parameter(torch.randn(M, KU + KC, generator=generator) / 4)

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
        narrow_users = F.scaled_dot_product_attention(
            q[..., :32], k_u[..., :32][cand_to_user], v_u[..., :32][cand_to_user]
        )
        per_user_only = torch.relu(e_u[cand_to_user])
        user_features = x_u[cand_to_user]
        return (
            causal,
            small_heads,
            narrow_users,
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
    assert "head dim D=32; ikbo attention takes D in {64, 128, 256}" in reasons
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


def index_arguments(offset=0):
    """NegativeIndices' inputs, the mapping shifted by ``offset``."""
    inputs = request()
    weight = torch.randn(M, KU + KC, generator=torch.Generator().manual_seed(102))
    return (
        inputs["e_u"],
        inputs["e_c"],
        inputs["x_u"],
        inputs["x_c"],
        weight,
        inputs["cand_to_user"] + offset,
    )


def test_rewrites_that_raise_are_dropped():
    """The mapping is passed to the ikbo op as it is (a copy would cost the
    map cache its hits): negative indices make the rewritten graph raise, and
    the check drops the rewrites, with the library's message."""
    model, arguments = NegativeIndices(), index_arguments(-NUM_USERS)
    rewritten = rewrite.optimize(model, arguments, verbose=False)
    report = rewritten.ikbo_report
    assert not report.rewritten and not ikbo_ops(rewritten)
    assert len(report.left) == 2
    for item in report.left:
        assert "was dropped: the rewritten graph raised ValueError" in item.reason
        assert "cand_to_user" in item.reason  # the library's own message
    assert_same_outputs(rewritten, model, arguments)


def test_rewrites_that_change_results_are_dropped():
    """A tolerance no fp32 rounding meets: every rewrite fails the check."""
    model, arguments = NegativeIndices(), index_arguments()
    rewritten = rewrite.optimize(model, arguments, tolerance={torch.float32: 1e-15}, verbose=False)
    report = rewritten.ikbo_report
    assert not report.rewritten and not ikbo_ops(rewritten)
    assert len(report.left) == 2
    for item in report.left:
        assert "was dropped: output " in item.reason and "differs by relative error" in item.reason
    assert_same_outputs(rewritten, model, arguments)


def test_weights_given_as_graph_inputs():
    def linear_over_concat(x_u, x_c, weight, bias, cand_to_user):
        return F.linear(torch.cat([x_c, x_u[cand_to_user]], dim=1), weight, bias)

    inputs = request()
    generator = torch.Generator().manual_seed(103)
    weight, bias = torch.randn(6, 7, generator=generator), torch.randn(6, generator=generator)
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


# ---------------------------------------------------------------------------
# Gathers moved below per-row ops: the user tensor is replicated first, then
# goes through per-row layers (projections, activations, norms, views) before
# the interaction; the pass runs those layers once per user instead.

HEADS, HEAD_DIM, ITEM_DIM, HISTORY = 2, 64, 16, 12


def history_request(seed=0, counts=COUNTS):
    """A request for target attention onto each user's history [U, S, E]."""
    generator = torch.Generator().manual_seed(seed)
    num_candidates = sum(counts)
    return (
        torch.randn(num_candidates, HEADS, 4, HEAD_DIM, generator=generator),  # q [B, H, L, D]
        torch.randn(len(counts), HISTORY, ITEM_DIM, generator=generator),
        torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts)),
    )


class ProjectedHistory(torch.nn.Module):
    """Target attention written gather-first: the history is replicated to
    the candidates, normed, and projected to K and V per candidate (one
    gathered tensor feeding two branches; V's view reads sizes off the
    gathered tensor)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.norm = torch.nn.LayerNorm(ITEM_DIM)
        self.key = torch.nn.Linear(ITEM_DIM, HEADS * HEAD_DIM)
        self.value = torch.nn.Linear(ITEM_DIM, HEADS * HEAD_DIM)

    def forward(self, q, history, cand_to_user):
        h = self.norm(history[cand_to_user])  # [B, S, E]
        k = self.key(h).unflatten(-1, (HEADS, HEAD_DIM)).transpose(1, 2)
        v = self.value(h)
        v = v.view(v.shape[0], v.shape[1], HEADS, HEAD_DIM).permute(0, 2, 1, 3)
        return F.scaled_dot_product_attention(q, k, v)


def assert_matches(rewritten, model, inputs, tolerance=1e-5):
    """One output tensor, as the original model gives it."""
    with torch.no_grad():
        torch.testing.assert_close(
            rewritten(*inputs), model(*inputs), rtol=tolerance, atol=tolerance
        )


def traced_or_exported(model, inputs, graph):
    return model if graph == "symbolic_trace" else torch.export.export(model, inputs)


def gathers_by(module, index_name="cand_to_user"):
    """Nodes that gather rows by the mapping input."""
    mapping = next(node for node in module.graph.nodes if node.name == index_name)
    kinds = ("getitem", "index_select", "aten.index.Tensor", "aten.index_select.default")

    def name(target):
        return target if isinstance(target, str) else getattr(target, "__name__", "")

    return [
        user for user in mapping.users if str(user.target) in kinds or name(user.target) in kinds
    ]


@pytest.mark.parametrize("graph", ["symbolic_trace", "torch.export"])
def test_gather_moved_below_key_value_projections(graph, capsys):
    model, inputs = ProjectedHistory().eval(), history_request()
    rewritten = rewrite.optimize(traced_or_exported(model, inputs, graph), inputs)
    report = rewritten.ikbo_report
    assert report.tracer == graph and not report.left and report.max_error < 1e-5
    (item,) = report.rewritten
    assert item.op == "ikbo::attention" and item.mapping == "cand_to_user = cand_to_user"
    assert item.broadcasts == (["getitem"] if graph == "symbolic_trace" else ["index"])
    if graph == "symbolic_trace":
        # The heads/tokens swaps stay: the attention matcher reads through them.
        assert item.moved == [
            "norm (LayerNorm)",
            "key (Linear)",
            "unflatten",
            "value (Linear)",
            "view",
        ]
        printed = capsys.readouterr().out
        assert "moved above the gather (now run once per user): norm (LayerNorm), key" in printed
    else:
        kinds = [text.split(" (")[1].rstrip(")") for text in item.moved]
        assert kinds == [
            "aten.layer_norm.default",
            "aten.linear.default",
            "aten.unflatten.int",
            "aten.linear.default",
            "aten.view.default",
        ]
    assert ikbo_ops(rewritten) == ["ikbo.attention.default"]
    # No replicated history left: the norm and both projections run on [U, S, E].
    assert not gathers_by(rewritten)
    (attention,) = [n for n in rewritten.graph.nodes if str(n.target) == "ikbo.attention.default"]
    for operand in attention.args[1:3]:
        assert operand.meta["tensor_meta"].shape == (NUM_USERS, HISTORY, HEADS, HEAD_DIM)
    # A new request: other counts where the graph is symbolic, the same
    # shapes with a shuffled mapping where export fixed them.
    if graph == "symbolic_trace":
        other = history_request(seed=1, counts=(1, 5, 3, 2))
    else:
        q, history, cand_to_user = history_request(seed=1)
        other = (q, history, cand_to_user[torch.randperm(NUM_CANDIDATES)])
    assert_matches(rewritten, model, other)


def replicate(x_u, counts, num_candidates, spelling):
    """x_u [U, F] replicated to the candidates in one of the recognized spellings."""
    if spelling == "index_select":
        return x_u.index_select(0, torch.repeat_interleave(counts))
    if spelling == "getitem":
        return x_u[torch.repeat_interleave(counts)]
    if spelling == "repeat_interleave_counts":
        return torch.repeat_interleave(x_u, counts, dim=0)
    if spelling == "repeat_interleave_int":
        return x_u.repeat_interleave(num_candidates // x_u.shape[0], dim=0)
    if spelling == "unsqueeze_expand_reshape":
        ratio = num_candidates // x_u.shape[0]
        return x_u.unsqueeze(1).expand(-1, ratio, -1).reshape(num_candidates, -1)
    return x_u[:1].expand(num_candidates, -1)  # one user


class TowerAfterGather(torch.nn.Module):
    """A user tower applied per candidate: gather -> Linear -> ReLU -> Dropout
    (eval) -> scale and shift by parameters -> cat with candidate features ->
    Linear."""

    def __init__(self, spelling="index_select"):
        super().__init__()
        torch.manual_seed(8)
        self.spelling = spelling
        self.tower = torch.nn.Linear(4, 6)
        self.dropout = torch.nn.Dropout(0.1)
        self.scale = torch.nn.Parameter(torch.randn(6))
        self.head = torch.nn.Linear(6 + 3, 5)

    def forward(self, x_u, x_c, counts):
        gathered = replicate(x_u, counts, x_c.shape[0], self.spelling)
        h = self.dropout(torch.relu(self.tower(gathered))) * self.scale + 1.0
        return self.head(torch.cat([h, x_c], dim=-1))


@pytest.mark.parametrize("graph", ["symbolic_trace", "torch.export"])
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
def test_gather_moved_below_user_tower(spelling, graph):
    counts = (3, 3, 3)
    inputs = request(counts=counts)
    arguments = (inputs["x_u"], inputs["x_c"], torch.tensor(counts))
    model = TowerAfterGather(spelling).eval()
    rewritten = rewrite.optimize(
        traced_or_exported(model, arguments, graph), arguments, verbose=False
    )
    report = rewritten.ikbo_report
    assert ikbo_ops(rewritten) == ["ikbo.linear.default"], report
    assert not report.left and report.max_error < 1e-5
    (item,) = report.rewritten
    assert "Ku=6 user / Kc=3 candidate" in item.detail
    if graph == "symbolic_trace":
        assert item.moved == ["tower (Linear)", "relu", "dropout (Dropout)", "mul", "add"]
    else:
        moved = [text.split(" (")[0] for text in item.moved]
        assert moved == ["linear", "relu", "dropout", "mul", "add"]
    # The tower runs on the U user rows, and ikbo::linear takes its output.
    (linear,) = [n for n in rewritten.graph.nodes if str(n.target) == "ikbo.linear.default"]
    assert linear.args[3].meta["tensor_meta"].shape[0] == (
        1 if spelling == "expand_one_user" else 3
    )
    other = request(seed=5, counts=counts)
    other = (other["x_u"], other["x_c"], torch.tensor(counts))
    assert_matches(rewritten, model, other)


class RowMixing(torch.nn.Module):
    """A user tower whose gathered output meets an op that mixes rows (or
    pairs them with per-candidate data) before the interaction."""

    def __init__(self, variant):
        super().__init__()
        torch.manual_seed(9)
        self.variant = variant
        self.tower = torch.nn.Linear(4, 6)
        self.norm = torch.nn.BatchNorm1d(6)
        self.head = torch.nn.Linear(6 + 3, 5)

    def forward(self, x_u, x_c, w_c, cand_to_user):
        h = self.tower(x_u[cand_to_user])
        if self.variant == "softmax_over_candidates":
            h = torch.softmax(h, dim=0)
        elif self.variant == "batchnorm_training":
            h = self.norm(h)
        elif self.variant == "matmul_per_candidate":
            h = torch.matmul(h.unsqueeze(1), w_c).squeeze(1)  # w_c [B, 6, 6]
        elif self.variant == "scale_per_candidate":
            h = h * w_c[:, 0]  # [B, 6]
        return self.head(torch.cat([h, x_c], dim=-1))


@pytest.mark.parametrize("graph", ["symbolic_trace", "torch.export"])
@pytest.mark.parametrize(
    "variant",
    [
        "softmax_over_candidates",
        "batchnorm_training",
        "matmul_per_candidate",
        "scale_per_candidate",
    ],
)
def test_ops_mixing_rows_stop_the_gather(variant, graph):
    inputs = request()
    w_c = torch.randn(NUM_CANDIDATES, 6, 6, generator=torch.Generator().manual_seed(3))
    arguments = (inputs["x_u"], inputs["x_c"], w_c, inputs["cand_to_user"])
    model = RowMixing(variant).eval()
    model.norm.train(variant == "batchnorm_training")
    rewritten = rewrite.optimize(
        traced_or_exported(model, arguments, graph), arguments, verbose=False
    )
    report = rewritten.ikbo_report
    assert not report.rewritten and not ikbo_ops(rewritten)
    (left,) = report.left
    # Nothing was moved: the gather is still where the model put it.
    assert left.node.split(" ")[0] in ("getitem", "index") and "moved below" not in left.node
    why = {
        "softmax_over_candidates": "normalizes over dim 0, mixing candidates",
        "batchnorm_training": "normalizes with statistics over the whole batch",
        "matmul_per_candidate": "takes an operand w_c that has a row per candidate",
        "scale_per_candidate": "that has a row per candidate",  # w_c[:, 0], named per graph
    }[variant]
    assert "would bring it to" in left.reason and why in left.reason, left.reason
    assert_matches(rewritten, model, arguments)


class SumOverCandidates(torch.nn.Module):
    """The gathered tower output is centred by its sum over dim 0: the
    subtraction acts per row (the sum is one shared vector) and is moved, the
    sum mixes candidates and is not."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(10)
        self.tower = torch.nn.Linear(4, 6)
        self.head = torch.nn.Linear(6 + 3, 5)

    def forward(self, x_u, x_c, cand_to_user):
        h = self.tower(x_u[cand_to_user])
        h = h - h.sum(0)
        return self.head(torch.cat([h, x_c], dim=-1))


@pytest.mark.parametrize("graph", ["symbolic_trace", "torch.export"])
def test_sum_over_candidates_is_not_moved(graph, capsys):
    inputs = request()
    arguments = (inputs["x_u"], inputs["x_c"], inputs["cand_to_user"])
    model = SumOverCandidates().eval()
    rewritten = rewrite.optimize(traced_or_exported(model, arguments, graph), arguments)
    report = rewritten.ikbo_report
    (item,) = report.rewritten
    assert item.op == "ikbo::linear"
    assert [text.split(" (")[0] for text in item.moved] == [
        "tower" if graph == "symbolic_trace" else "linear",
        "sub",
    ]
    # The sum still reads the tower output gathered to the candidates.
    (left,) = report.left
    assert "moved below" in left.node and "the gather of" in left.node
    assert "the gather cannot move below sum_1" in left.reason
    assert "reduces over dim 0, mixing candidates" in left.reason
    printed = capsys.readouterr().out
    assert "1 rewritten, 1 broadcast(s) left" in printed
    assert_matches(rewritten, model, arguments)


class InPlaceAfterTower(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.tower = torch.nn.Linear(4, 6)
        self.head = torch.nn.Linear(6 + 3, 5)

    def forward(self, x_u, x_c, cand_to_user):
        h = self.tower(x_u[cand_to_user])
        h.relu_()
        return self.head(torch.cat([h, x_c], dim=-1))


def test_no_move_across_in_place_writes():
    inputs = request()
    arguments = (inputs["x_u"], inputs["x_c"], inputs["cand_to_user"])
    model = InPlaceAfterTower().eval()
    rewritten = rewrite.optimize(model, arguments, verbose=False)
    report = rewritten.ikbo_report
    assert not report.rewritten
    (left,) = report.left
    assert "cannot move below tower, which has a result that an in-place op may modify" in (
        left.reason
    )
    assert_matches(rewritten, model, arguments)


def test_moved_gathers_under_torch_compile(capsys):
    model, inputs = ProjectedHistory().eval(), history_request()
    compiled = torch.compile(model, backend=rewrite.backend, fullgraph=True)
    with torch.no_grad():
        outputs = compiled(*inputs)
    printed = capsys.readouterr().out
    assert "1 rewritten, 0 broadcast(s) left" in printed and "moved above the gather" in printed
    torch.testing.assert_close(outputs, model(*inputs), rtol=1e-5, atol=1e-5)


class NormedEmbeddingsAndResidual(torch.nn.Module):
    """LCE over user embeddings normed and scaled per candidate, and a linear
    over a residual user tower (both operands of the add are gathered)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(12)
        self.norm = torch.nn.LayerNorm(N)
        self.compression = torch.nn.Parameter(torch.randn(M, KU + KC) / 4)
        self.tower = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4 + 3, 6)

    def forward(self, e_u, e_c, x_u, x_c, cand_to_user):
        embeddings = self.norm(e_u[cand_to_user]) * 0.5
        compressed = torch.matmul(self.compression, torch.cat([embeddings, e_c], dim=1))
        h = x_u.index_select(0, cand_to_user)
        h = h + self.tower(h)
        return compressed, self.head(torch.cat([h, x_c], dim=-1))


@pytest.mark.parametrize("graph", ["symbolic_trace", "torch.export"])
def test_gather_moved_for_lce_and_below_a_residual(graph):
    inputs = request()
    arguments = tuple(inputs[name] for name in ("e_u", "e_c", "x_u", "x_c", "cand_to_user"))
    model = NormedEmbeddingsAndResidual().eval()
    rewritten = rewrite.optimize(
        traced_or_exported(model, arguments, graph), arguments, verbose=False
    )
    report = rewritten.ikbo_report
    assert ikbo_ops(rewritten) == ["ikbo.lce.default", "ikbo.linear.default"]
    assert not report.left and not gathers_by(rewritten)
    moved = {item.op: [text.split(" (")[0] for text in item.moved] for item in report.rewritten}
    assert moved["ikbo::lce"] == ["norm" if graph == "symbolic_trace" else "layer_norm", "mul"]
    assert moved["ikbo::linear"] == ["tower" if graph == "symbolic_trace" else "linear", "add"]
    with torch.no_grad():
        for got, want in zip(rewritten(*arguments), model(*arguments)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_dropped_rewrite_keeps_its_ops_below_the_gather():
    """A rewrite that fails the check (a tolerance no fp32 rounding meets)
    puts the tower it moved back below the gather."""
    counts = (3, 3, 3)
    inputs = request(counts=counts)
    arguments = (inputs["x_u"], inputs["x_c"], torch.tensor(counts))
    model = TowerAfterGather("getitem").eval()

    class Mapping(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x_u, x_c, counts):
            idx = torch.repeat_interleave(counts)
            h = torch.relu(self.inner.tower(x_u[idx])) * self.inner.scale + 1.0
            return self.inner.head(torch.cat([h, x_c], dim=-1))

    mapped = Mapping().eval()
    rewritten = rewrite.optimize(mapped, arguments, tolerance={torch.float32: 1e-15}, verbose=False)
    report = rewritten.ikbo_report
    assert not report.rewritten and not ikbo_ops(rewritten)
    (left,) = report.left
    assert "rewriting inner_head (inner.head) as ikbo::linear was dropped" in left.reason
    assert "differs by relative error" in left.reason
    (tower,) = [node for node in rewritten.graph.nodes if node.target == "inner.tower"]
    assert tower.args[0].name == left.node  # still on the candidate rows
    assert_matches(rewritten, mapped, arguments)


def lce_request(num_candidates, num_users, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(num_users, KU, N, generator=generator),
        torch.randn(num_candidates, KC, N, generator=generator),
        torch.randint(0, num_users, (num_candidates,), generator=generator),
    )


def test_one_candidate_samples_do_not_make_per_candidate_operands_shared():
    """With B = 1 a [1, M, K] weight or a one-row tensor expanded to the
    candidates may as well have a row per candidate: left, not rewritten."""

    class PerCandidateWeight(torch.nn.Module):
        def forward(self, weights, e_u, e_c, cand_to_user):  # weights [B, M, Ku + Kc]
            return torch.bmm(weights, torch.cat([e_u[cand_to_user], e_c], dim=1))

    class ExpandedContext(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.projection = torch.nn.Linear(4 + 3, 6)

        def forward(self, context, x_c):  # context [1, 4] or [B, 4]
            expanded = context.expand(x_c.shape[0], -1)
            return self.projection(torch.cat([expanded, x_c], dim=-1))

    generator = torch.Generator().manual_seed(8)
    model = PerCandidateWeight()
    rewritten = rewrite.optimize(
        model, (torch.randn(1, M, KU + KC, generator=generator), *lce_request(1, 1)), verbose=False
    )
    assert not ikbo_ops(rewritten)
    assert "may have a matrix per candidate" in rewritten.ikbo_report.left[0].reason
    assert_matches(
        rewritten, model, (torch.randn(8, M, KU + KC, generator=generator), *lce_request(8, 3))
    )
    context_model = ExpandedContext().eval()
    rewritten = rewrite.optimize(
        context_model, (torch.randn(1, 4), torch.randn(1, 3)), verbose=False
    )
    assert not ikbo_ops(rewritten)
    assert_matches(rewritten, context_model, (torch.randn(5, 4), torch.randn(5, 3)))


def test_in_place_writes_to_what_the_ikbo_op_reads_leave_the_consumer():
    """A clamp_ of the concat the sample never reaches, and a write to a
    candidate operand between the concat and the matmul: the ikbo op would
    miss both, so the matmul stays as written."""

    class ClampedConcat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(M, KU + KC) / 4)

        def forward(self, e_u, e_c, cand_to_user):
            concat = torch.cat([e_u[cand_to_user], e_c], dim=1)
            concat.clamp_(-10.0, 10.0)
            return torch.matmul(self.weight, concat)

    class ScaledAfterConcat(ClampedConcat):
        def forward(self, e_u, e_c, cand_to_user):
            concat = torch.cat([e_u[cand_to_user], e_c], dim=1)
            e_c.mul_(0.5)
            return torch.matmul(self.weight, concat) + e_c.sum()

    for model in (ClampedConcat(), ScaledAfterConcat()):
        sample = lce_request(6, 3)
        copies = [value.clone() for value in sample]
        rewritten = rewrite.optimize(model, sample, verbose=False)
        assert not ikbo_ops(rewritten)
        assert "may be modified by an in-place op" in rewritten.ikbo_report.left[0].reason
        assert all(torch.equal(a, b) for a, b in zip(sample, copies)), "optimize wrote its inputs"
        e_u, e_c, cand_to_user = lce_request(6, 3, seed=1)
        request_ = (e_u * 50, e_c, cand_to_user)  # past the clamp
        expected = model(*[value.clone() for value in request_])
        torch.testing.assert_close(rewritten(*request_), expected)


@pytest.mark.parametrize("returns_buffer", [False, True])
def test_results_left_in_buffers_are_checked(returns_buffer):
    """A rewrite whose result reaches a buffer, returned or not, is checked
    there (a tolerance no fp32 rounding meets drops it), and optimize leaves
    the module's buffers as it found them."""

    class CachesItsResult(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(M, KU + KC) / 4)
            self.register_buffer("cache", torch.zeros(6, M, N))

        def forward(self, e_u, e_c, cand_to_user):
            self.cache.copy_(torch.matmul(self.weight, torch.cat([e_u[cand_to_user], e_c], 1)))
            return self.cache if returns_buffer else e_u.sum()

    model = CachesItsResult()
    rewritten = rewrite.optimize(
        model, lce_request(6, 3), tolerance={torch.float32: 1e-15}, verbose=False
    )
    assert not ikbo_ops(rewritten)
    differing = "output 0" if returns_buffer else "output 1"
    assert f"{differing} differs by relative error" in rewritten.ikbo_report.left[0].reason
    assert not model.cache.any(), "optimize left a result in the module's buffer"
    rewritten = rewrite.optimize(model, lce_request(6, 3), verbose=False)
    assert ikbo_ops(rewritten) == ["ikbo.lce.default"]


def test_candidates_per_user_read_at_run_time():
    """x_u.unsqueeze(1).expand(U, R, ...).reshape(U * R, ...) with R computed
    from the request: other requests have other R."""

    class Uniform(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(M, KU + KC) / 4)

        def forward(self, e_u, e_c):
            users, repeats = e_u.shape[0], e_c.shape[0] // e_u.shape[0]
            gathered = e_u.unsqueeze(1).expand(users, repeats, KU, N).reshape(-1, KU, N)
            return torch.matmul(self.weight, torch.cat([gathered, e_c], dim=1))

    model = Uniform()
    rewritten = rewrite.optimize(model, lce_request(6, 2)[:2], verbose=False)
    assert ikbo_ops(rewritten) == ["ikbo.lce.default"]
    for users, repeats in ((4, 3), (3, 2), (6, 1)):
        assert_matches(rewritten, model, lce_request(users * repeats, users)[:2])


def test_module_tables_are_lookups_not_user_broadcasts():
    class Lookup(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(1000, 4))
            self.projection = torch.nn.Linear(4 + 3, 6)

        def forward(self, item_ids, x_c):
            return self.projection(torch.cat([self.table[item_ids], x_c], dim=-1))

    rewritten = rewrite.optimize(
        Lookup().eval(), (torch.tensor([5, 999, 5]), torch.randn(3, 3)), verbose=False
    )
    assert not ikbo_ops(rewritten) and not rewritten.ikbo_report.left


def test_exported_models_take_other_request_sizes():
    """A model symbolic tracing cannot follow (a Python branch on a size) is
    exported with dim 0 of its inputs dynamic."""

    class Branches(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.projection = torch.nn.Linear(4 + 3, 6)

        def forward(self, x_u, x_c, cand_to_user):
            if x_c.shape[0] > 1000:
                x_c = x_c * 0.5
            return self.projection(torch.cat([x_u[cand_to_user], x_c], dim=-1))

    model = Branches().eval()
    sample = (torch.randn(3, 4), torch.randn(5, 3), torch.tensor([0, 0, 1, 2, 2]))
    rewritten = rewrite.optimize(model, sample, verbose=False)
    assert rewritten.ikbo_report.tracer == "torch.export"
    assert ikbo_ops(rewritten) == ["ikbo.linear.default"]
    assert_matches(
        rewritten, model, (torch.randn(2, 4), torch.randn(7, 3), torch.tensor([0, 1] * 3 + [1]))
    )


def run_compiled(model, requests, dynamic, compiler="eager"):
    """Compiles ``model`` with the ikbo backend, runs it on each request,
    checks every output against the model's and that no graph was left as
    captured, and returns the reports of the graphs compiled."""
    torch._dynamo.reset()
    reports = []
    backend = rewrite.make_backend(compiler, verbose=False, on_report=reports.append)
    compiled = torch.compile(model, backend=backend, dynamic=dynamic)
    for inputs in requests:
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got, want = compiled(*inputs), model(*inputs)
        left = [str(item.message) for item in caught if "ikbo.rewrite" in str(item.message)]
        assert not left, left
        got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
        for actual, expected in zip(got, want):
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    return reports


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
def test_torch_compile_backend_on_new_request_sizes(compiler):
    """Every graph torch.compile traces is rewritten: one per request size
    with dynamic=False; with automatic dynamic shapes a static graph for the
    first size, then one graph with symbolic B and U that serves every later
    size; with dynamic=True one graph from the start."""
    model = RankingModel().eval()
    # No B or U equal to a feature size: dynamo would give them one symbol.
    counts = ((2, 1, 1, 2, 1, 2, 1, 2, 1), (1,) * 7 + (2,) * 4, (3, 1) * 6 + (1,), (1, 2) * 9)
    requests = [tuple(request(seed=seed, counts=c).values()) for seed, c in enumerate(counts)]
    expected_graphs = {False: len(requests), None: 2, True: 1}
    for dynamic, graphs in expected_graphs.items():
        reports = run_compiled(model, requests, dynamic, compiler)
        assert len(reports) == graphs, (dynamic, reports)
        for report in reports:
            assert sorted(item.op for item in report.rewritten) == [
                "ikbo::attention",
                "ikbo::lce",
                "ikbo::linear",
            ]
            assert not report.left, report
    # In the dynamic graph the weight split and the attention's S are symbolic.
    assert "Kc=16 - s" in " ".join(item.detail for item in reports[0].rewritten)


@pytest.mark.parametrize(
    "spelling", ["repeat_interleave_int", "unsqueeze_expand_reshape", "expand_one_user"]
)
def test_dynamic_shape_graphs_move_gathers(spelling):
    """Gathers spelled with sizes (R = B // U, B of one user) are found and
    moved below the user tower in a graph with symbolic sizes, which then
    serves every request size."""
    model = TowerAfterGather(spelling).eval()
    if spelling == "expand_one_user":
        counts = [(7,), (11,), (13,)]
    else:  # no B or U equal to a feature size: dynamo would give them one symbol
        counts = [(2,) * 7, (3,) * 11, (2,) * 13]
    requests = []
    for seed, c in enumerate(counts):
        inputs = request(seed=seed, counts=c)
        requests.append((inputs["x_u"], inputs["x_c"], torch.tensor(c)))
    (report,) = run_compiled(model, requests, dynamic=True)
    (item,) = report.rewritten
    assert item.op == "ikbo::linear" and len(item.moved) == 5 and not report.left


def test_dynamic_shape_graphs_read_sizes_at_run_time():
    """A view whose leading size torch.compile traced as a graph input (the
    candidate count) is moved like one reading the gathered tensor's size."""
    model = ProjectedHistory().eval()
    counts = ((2, 1) * 3 + (4,), (1, 2) * 5 + (2,), (3, 1) * 6 + (1,))  # B, U no feature size
    requests = [history_request(seed=seed, counts=c) for seed, c in enumerate(counts)]
    (report,) = run_compiled(model, requests, dynamic=True)
    (item,) = report.rewritten
    assert item.op == "ikbo::attention" and len(item.moved) == 5 and not report.left


def test_size_decisions_guard_the_compiled_graph():
    """With duck shaping off, two user tensors of equal row counts in the
    sample get distinct symbols: the pass's check that they are equal guards
    the graph, so a request where they differ is compiled anew and that
    graph leaves the concat of different user counts as it is."""

    class TwoUserTensors(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(4 + 4 + 3, 6)

        def forward(self, a_u, b_u, x_c, cand_to_user):
            users = torch.cat([a_u[cand_to_user], b_u[cand_to_user]], dim=-1)
            return self.head(torch.cat([users, x_c], dim=-1))

    model = TwoUserTensors().eval()
    cand_to_user = torch.tensor([0, 0, 1, 2, 2, 2, 1])
    same = (torch.randn(3, 4), torch.randn(3, 4), torch.randn(7, 3), cand_to_user)
    more = (torch.randn(3, 4), torch.randn(5, 4), torch.randn(7, 3), cand_to_user)
    with torch.fx.experimental._config.patch(use_duck_shape=False):
        first, second = run_compiled(model, [same, more], dynamic=True)
    assert [item.op for item in first.rewritten] == ["ikbo::linear"]
    assert not second.rewritten
    (left,) = {item.reason for item in second.left}
    assert "takes operands gathered from different numbers of users" in left, left


def test_row_counts_of_gathers_by_counts_trace_in_the_inner_compiler():
    """repeat_interleave(x_u, counts) traced whole (dynamo capturing its
    data-dependent size): the gather is moved below the user tower, and the
    row count dynamo's graph reads of it is computed in a form aot_eager can
    trace too."""
    model = TowerAfterGather("repeat_interleave_counts").eval()
    counts = (3, 1, 2, 3, 1, 2, 3)
    inputs = request(counts=counts)
    arguments = (inputs["x_u"], inputs["x_c"], torch.tensor(counts))
    config = {"capture_dynamic_output_shape_ops": True, "capture_scalar_outputs": True}
    for dynamic in (False, True):
        with torch._dynamo.config.patch(config):
            (report, *_) = run_compiled(model, [arguments], dynamic, "aot_eager")
        assert [item.op for item in report.rewritten] == ["ikbo::linear"]


def test_gathers_by_counts_keep_their_output_size():
    """repeat_interleave(x_u, counts, output_size=B) traces without a
    data-dependent size; the index and the gather the rewrite builds from it
    keep output_size, so aot_eager traces the rewritten graph without a
    graph break (which would drop the compile and leave the gather)."""

    class KnownRows(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tower = torch.nn.Linear(4, 6)
            self.head = torch.nn.Linear(6 + 3, 5)

        def forward(self, x_u, x_c, counts):
            gathered = torch.repeat_interleave(x_u, counts, dim=0, output_size=x_c.shape[0])
            return self.head(torch.cat([torch.relu(self.tower(gathered)), x_c], dim=-1))

    requests = []
    for seed, counts in enumerate(((3, 1, 2, 3, 1, 4, 3), (1, 2) * 6 + (5,), (4,) * 9)):
        inputs = request(seed=seed, counts=counts)
        requests.append((inputs["x_u"], inputs["x_c"], torch.tensor(counts)))
    reports = run_compiled(KnownRows().eval(), requests, None, "aot_eager")
    assert len(reports) == 2
    for report in reports:
        assert [item.op for item in report.rewritten] == ["ikbo::linear"] and not report.left


def compiled_with_warnings(model, inputs, backend):
    """The compiled model's outputs on ``inputs`` and the warnings it raised."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outputs = compiled(*inputs)
    return outputs, [str(item.message) for item in caught if "ikbo.rewrite" in str(item.message)]


def test_backend_leaves_graphs_it_cannot_check_or_compile(monkeypatch):
    """The backend never fails a compile torch could do without it: a graph
    it cannot check (sizes marked unbacked have no value), a pass that
    fails, or an inner compiler refusing the rewritten graph leave the graph
    as captured, with a warning; the outputs stay the model's."""
    model, inputs = RankingModel().eval(), tuple(request().values())
    with torch.no_grad():
        expected = model(*inputs)

    def check(backend, reason):
        outputs, caught = compiled_with_warnings(model, inputs, backend)
        assert len(caught) == 1 and reason in caught[0], caught
        for got, want in zip(outputs, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    cand_to_user, e_c = inputs[-1], inputs[1]
    torch._dynamo.decorators.mark_unbacked(cand_to_user, 0)
    torch._dynamo.decorators.mark_unbacked(e_c, 0)
    check(rewrite.make_backend(verbose=False), "sizes without a value to check a rewrite on")
    inputs = tuple(request().values())  # unmarked

    def refusing(graph_module, example_inputs):
        if any(str(node.target).startswith("ikbo.") for node in graph_module.graph.nodes):
            raise RuntimeError("no custom ops here")
        return graph_module.forward

    check(
        rewrite.make_backend(refusing, verbose=False),
        "failed on the rewritten graph: RuntimeError: no custom ops here",
    )

    def failing(*args, **kwargs):
        raise RuntimeError("a defect of the pass")

    monkeypatch.setattr(rewrite, "optimize", failing)
    check(rewrite.make_backend(verbose=False), "the pass failed: RuntimeError: a defect")


def test_the_check_bounds_every_element():
    """One element off by half among a thousand ones passes a 2% relative
    Frobenius norm (1.6%) but not the per-element bound (0.02 * 9)."""
    expected = torch.ones(1000)
    actual = expected.clone()
    actual[123] += 0.5
    tolerance = {torch.float32: 0.02}
    assert rewrite._compare(expected, expected.clone(), tolerance) == 0.0
    with pytest.raises(rewrite._Mismatch, match="1 elements off by more than"):
        rewrite._compare(expected, actual, tolerance)


# ---- nn.MultiheadAttention over a replicated history ----

MHA_EMBED, MHA_SEEDS = 128, 4  # two heads of D = 64


def mha_request(seed=0, counts=COUNTS, key_dim=MHA_EMBED):
    """Seed queries per candidate [B, L, E], two user histories [U, S, E_kv]."""
    generator = torch.Generator().manual_seed(seed)
    num_candidates = sum(counts)
    return (
        torch.randn(num_candidates, MHA_SEEDS, MHA_EMBED, generator=generator),
        torch.randn(len(counts), HISTORY, key_dim, generator=generator),
        torch.randn(len(counts), HISTORY, key_dim, generator=generator),
        torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts)),
    )


class HistoryMha(torch.nn.Module):
    """Target attention through nn.MultiheadAttention: each candidate's seed
    queries attend to its user's history, replicated to the candidates (K
    and V from one history, or from two; batch-first or seq-first)."""

    def __init__(self, batch_first=True, two_histories=False, key_dim=None, read=0, **options):
        super().__init__()
        torch.manual_seed(11)
        self.attention = torch.nn.MultiheadAttention(
            MHA_EMBED, 2, batch_first=batch_first, kdim=key_dim, vdim=key_dim, **options
        )
        self.two_histories, self.read = two_histories, read

    def forward(self, q, keys, values, cand_to_user):
        return self.attend(q, keys, values, cand_to_user, None)

    def attend(self, q, keys, values, cand_to_user, key_padding_mask):
        k = keys[cand_to_user]
        v = values[cand_to_user] if self.two_histories else k
        if not self.attention.batch_first:
            q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        outputs = self.attention(q, k, v, key_padding_mask=key_padding_mask)
        return outputs[self.read]


class MaskedHistoryMha(HistoryMha):
    def forward(self, q, keys, values, cand_to_user, key_padding_mask):
        return self.attend(q, keys, values, cand_to_user, key_padding_mask)


MHA_VARIANTS = {
    "batch_first": {},
    "seq_first": {"batch_first": False},
    "two_histories": {"two_histories": True},
    "key_dim": {"key_dim": 48, "two_histories": True},
    "no_bias": {"bias": False},
}


def mha_model_and_request(variant, seed=0, counts=COUNTS):
    options = MHA_VARIANTS[variant]
    return HistoryMha(**options).eval(), mha_request(
        seed, counts, options.get("key_dim", MHA_EMBED)
    )


def assert_mha_rewritten(report, rewritten, inputs):
    assert not report.left and report.max_error < 1e-5, report
    (item,) = report.rewritten
    assert item.op == "ikbo::attention"
    assert "multi-head attention H=2, D=64, S=12; its K/V projections run once per user" in (
        item.detail
    )
    (attention,) = [n for n in rewritten.graph.nodes if str(n.target) == "ikbo.attention.default"]
    ShapeProp(rewritten).propagate(*inputs)
    for operand in attention.args[1:3]:  # K and V projected per user
        assert operand.meta["tensor_meta"].shape == (NUM_USERS, HISTORY, 2, MHA_EMBED // 2)


def keys_width(model):
    return model.attention.kdim


@pytest.mark.parametrize("variant", MHA_VARIANTS)
def test_multihead_attention_module(variant):
    model, inputs = mha_model_and_request(variant)
    rewritten = rewrite.optimize(model, inputs, verbose=False)
    assert_mha_rewritten(rewritten.ikbo_report, rewritten, inputs)
    assert ikbo_ops(rewritten) == ["ikbo.attention.default"]
    assert not gathers_by(rewritten)  # no replicated history left
    # Another request: other counts, an unsorted mapping.
    q, keys, values, cand_to_user = mha_request(1, (1, 5, 3, 2), keys_width(model))
    assert_matches(rewritten, model, (q, keys, values, cand_to_user.flip(0)))


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
@pytest.mark.parametrize("variant", ["batch_first", "seq_first", "key_dim"])
def test_multihead_attention_under_torch_compile(variant, compiler):
    """torch.compile records F.multi_head_attention_forward on seq-first
    transposes; every graph over four request sizes is rewritten."""
    model, _ = mha_model_and_request(variant)
    counts = ((2, 1, 1, 2, 1), (1,) * 7 + (2,) * 4, (3, 1) * 6, (1, 2) * 9)
    width = keys_width(model)
    requests = [mha_request(seed, c, width) for seed, c in enumerate(counts)]
    reports = run_compiled(model, requests, dynamic=None, compiler=compiler)
    assert len(reports) == 2
    for report in reports:
        (item,) = report.rewritten
        assert item.op == "ikbo::attention" and not report.left, report


@pytest.mark.parametrize(
    ("options", "mask", "reason"),
    [
        ({"read": 1}, False, "its attention weights are read"),
        ({}, True, "it has a key_padding_mask"),
        ({"add_bias_kv": True}, False, "it has bias_k (add_bias_kv or static K/V)"),
        ({"add_zero_attn": True}, False, "adds a zero key (add_zero_attn)"),
        ({"dropout": 0.5, "training": True}, False, "dropout_p=0.5 in training"),
    ],
)
def test_multihead_attention_left_with_a_reason(options, mask, reason):
    training = options.pop("training", False)
    model = (MaskedHistoryMha if mask else HistoryMha)(**options).train(training)
    inputs = mha_request()
    if mask:  # per candidate, which ikbo attention has no place for
        inputs += (torch.rand(inputs[0].shape[0], HISTORY) < 0.2,)
    torch.manual_seed(0)
    rewritten = rewrite.optimize(model, inputs, verbose=False)
    report = rewritten.ikbo_report
    assert not report.rewritten
    (left,) = report.left
    assert reason in left.reason, left.reason
    assert ikbo_ops(rewritten) == []


@requires_torch_cuda(torch)
def test_multihead_attention_on_cuda_in_half_precision():
    model = HistoryMha().eval().to("cuda", torch.float16)

    def on_cuda(request):
        return tuple(x.cuda().half() if x.is_floating_point() else x.cuda() for x in request)

    inputs = on_cuda(mha_request())
    rewritten = rewrite.optimize(model, inputs, verbose=False)
    (item,) = rewritten.ikbo_report.rewritten
    assert item.op == "ikbo::attention" and not rewritten.ikbo_report.left
    compiled = torch.compile(model, backend=rewrite.make_backend(verbose=False))
    other = on_cuda(mha_request(1, (1, 5, 3, 2)))
    with torch.no_grad():
        want = model(*other)
        for got in (rewritten(*other), compiled(*other)):
            torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


class HistoryDecoder(torch.nn.Module):
    """Candidate seeds decoded against the user's history as memory,
    replicated to the candidates: the layers' cross-attention is ikbo's."""

    def __init__(self, layers):
        super().__init__()
        torch.manual_seed(13)
        layer = torch.nn.TransformerDecoderLayer(MHA_EMBED, 2, 256, batch_first=True)
        self.decoder = layer if layers is None else torch.nn.TransformerDecoder(layer, layers)

    def forward(self, q, history, cand_to_user):
        return self.decoder(q, history[cand_to_user])


def decoder_request(seed=0, counts=COUNTS):
    q, history, _, cand_to_user = mha_request(seed, counts)
    return q, history, cand_to_user


def test_transformer_decoder_layer_is_traced_into():
    model, inputs = HistoryDecoder(None).eval(), decoder_request()
    rewritten = rewrite.optimize(model, inputs, verbose=False)
    report = rewritten.ikbo_report
    assert report.tracer == "symbolic_trace" and not report.left, report
    (item,) = report.rewritten
    assert item.node == "decoder_multihead_attn" and item.op == "ikbo::attention"
    assert not gathers_by(rewritten)
    assert_matches(rewritten, model, decoder_request(1, (1, 5, 3, 2)))


def test_transformer_decoder_under_torch_compile():
    """A stack of two layers (symbolic tracing cannot follow the stack's
    checks; torch.compile does): both cross-attentions are rewritten."""
    model = HistoryDecoder(2).eval()
    counts = ((2, 1, 1, 2, 1), (1,) * 7 + (2,) * 4, (3, 1) * 6)
    reports = run_compiled(
        model, [decoder_request(seed, c) for seed, c in enumerate(counts)], dynamic=None
    )
    assert len(reports) == 2
    for report in reports:
        assert [item.op for item in report.rewritten] == ["ikbo::attention"] * 2, report
        assert not report.left, report


class EncodedHistory(torch.nn.Module):
    """The history replicated to the candidates, encoded by a transformer
    encoder (a layer or a stack), then attended to by the candidates."""

    def __init__(self, stack):
        super().__init__()
        torch.manual_seed(17)
        layer = torch.nn.TransformerEncoderLayer(MHA_EMBED, 2, 256, batch_first=True)
        self.encoder = (
            torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False) if stack else layer
        )
        self.cross = torch.nn.MultiheadAttention(MHA_EMBED, 2, batch_first=True)

    def forward(self, q, history, cand_to_user):
        encoded = self.encoder(history[cand_to_user])
        return self.cross(q, encoded, encoded, need_weights=False)[0]


@pytest.mark.parametrize("stack", [False, True])
def test_transformer_encoder_moves_above_the_gather(stack):
    """An encoder treats each sequence apart: in a symbolic_trace graph the
    module runs once per user."""
    model = EncodedHistory(stack).eval()
    rewritten = rewrite.optimize(model, decoder_request(), verbose=False)
    (item,) = rewritten.ikbo_report.rewritten
    assert item.moved == [
        f"encoder ({'TransformerEncoder' if stack else 'TransformerEncoderLayer'})"
    ]
    assert not gathers_by(rewritten)
    assert_matches(rewritten, model, decoder_request(1, (1, 5, 3, 2)))


# torch 2.11 (the GPU machine's) has no fake-tensor support for the encoder
# layer's fast-path op under dynamic shapes (pytorch/pytorch#183916 added
# it): dynamo breaks the graph there (session 44, torch._dynamo.explain:
# "Operator does not support running with fake tensors"), the gather ends
# one graph and the cross-attention starts the next, so nothing can move the
# layer above the gather. Static shapes, and torch 2.15, keep one graph.
_DYNAMIC_ENCODER_BREAKS = tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 15)


@pytest.mark.parametrize(
    "dynamic",
    [
        False,
        pytest.param(
            None,
            marks=pytest.mark.xfail(
                _DYNAMIC_ENCODER_BREAKS,
                reason="torch 2.11 has no fake-tensor support for the encoder layer's op under "
                "dynamic shapes and breaks the graph there, between the gather and the layer",
                strict=False,
            ),
        ),
    ],
    ids=["static", "dynamic"],
)
@pytest.mark.parametrize("stack", [False, True])
def test_transformer_encoder_moves_above_the_gather_under_torch_compile(stack, dynamic):
    """Under torch.compile, in inference, each layer is its fast-path op. With
    ``dynamic=None`` the second request recompiles with dynamic shapes."""
    model = EncodedHistory(stack).eval()
    counts = ((2, 1, 1, 2, 1), (1,) * 7 + (2,) * 4, (3, 1) * 6)
    requests = [decoder_request(seed, c) for seed, c in enumerate(counts)]
    reports = run_compiled(model, requests, dynamic=dynamic)
    assert len(reports) == (3 if dynamic is False else 2), [str(report) for report in reports]
    for report in reports:
        assert len(report.rewritten) == 1, str(report)
        (item,) = report.rewritten
        assert len(item.moved) == (2 if stack else 1), item.moved
        assert all("_transformer_encoder_layer_fwd" in moved for moved in item.moved)


class BrokenAfterTheGather(torch.nn.Module):
    """Cross-attention over the replicated history, with a graph break
    between the gather and the attention."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(19)
        self.cross = torch.nn.MultiheadAttention(MHA_EMBED, 2, batch_first=True)

    def forward(self, q, history, cand_to_user):
        replicated = history[cand_to_user]
        torch._dynamo.graph_break()
        return self.cross(q, replicated, replicated, need_weights=False)[0]


def test_a_gather_that_leaves_its_graph_is_reported_as_such():
    """The graph before the break returns the gather: the report says why
    nothing consumes it there."""
    reports = run_compiled(BrokenAfterTheGather().eval(), [decoder_request()], dynamic=False)
    assert len(reports) == 2, [str(report) for report in reports]
    assert not any(report.rewritten for report in reports)
    (left,) = reports[0].left
    assert "used by output" in left.reason, left.reason
    assert "it leaves the graph" in left.reason and "graph break" in left.reason, left.reason


def test_transformer_encoder_in_training_mode_stays_below_the_gather():
    model = EncodedHistory(stack=False).eval()
    model.encoder.train()  # dropout draws per candidate
    rewritten = rewrite.optimize(model, decoder_request(), verbose=False)
    report = rewritten.ikbo_report
    assert not report.rewritten
    (left,) = report.left
    assert "drops values at random per candidate" in left.reason, left.reason


# Multi-level broadcasts: a request of users, the vendors (groups) of each
# user, and each vendor's candidates.


def multi_level_request(seed=0, vendors=(0, 2, 0, 2, 0, 1), candidates=None):
    """Inputs of MultiLevel: ``vendors`` gives each vendor's user (unsorted;
    user 1 of 3 has none when the default is used), ``candidates`` each
    candidate's vendor (unsorted, uneven; vendor 4 has none by default)."""
    if candidates is None:
        candidates = (5, 0, 3, 3, 1, 0, 5, 2, 3, 0, 5)
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=generator)

    num_users, num_vendors, num_candidates = max(vendors) + 1, len(vendors), len(candidates)
    return (
        randn(num_candidates, MHA_SEEDS, MHA_EMBED),
        randn(num_users, HISTORY, MHA_EMBED),
        randn(num_users, 4),
        randn(num_vendors, 3),
        randn(num_candidates, 5),
        torch.tensor(vendors),
        torch.tensor(candidates),
    )


class MultiLevel(torch.nn.Module):
    """The candidates attend to their user's history (broadcast through the
    vendors: ``history[vendor_to_user][cand_to_vendor]``, or by the composed
    index ``history[vendor_to_user[cand_to_vendor]]``); a vendor-level MLP
    takes user features beside the vendor's; a candidate-level MLP takes
    user and vendor features beside the candidate's."""

    def __init__(self, composed_index):
        super().__init__()
        torch.manual_seed(23)
        self.composed_index = composed_index
        self.cross = torch.nn.MultiheadAttention(MHA_EMBED, 2, batch_first=True)
        self.vendor_mlp = torch.nn.Linear(4 + 3, 6)
        self.mlp = torch.nn.Linear(4 + 3 + 5, 2)

    def forward(self, q, history, x_u, x_v, x_c, vendor_to_user, cand_to_vendor):
        if self.composed_index:
            replicated = history[vendor_to_user[cand_to_vendor]]
        else:
            replicated = history[vendor_to_user][cand_to_vendor]
        attended = self.cross(q, replicated, replicated, need_weights=False)[0]
        users_at_vendors = x_u[vendor_to_user]
        vendor = self.vendor_mlp(torch.cat([users_at_vendors, x_v], -1))
        features = [users_at_vendors[cand_to_vendor], x_v[cand_to_vendor], x_c]
        return attended, vendor, self.mlp(torch.cat(features, -1))


MULTI_LEVEL_MAPPINGS = {
    # Attention reads each user's history once, by the composed mapping.
    "cross": "cand_to_user = vendor_to_user[cand_to_vendor]",
    "vendor_mlp": "cand_to_user = vendor_to_user",
    # User features beside vendor features: both from the vendor level.
    "mlp": "cand_to_user = cand_to_vendor",
}


def multi_level_mappings(report):
    mappings = {}
    for item in report.rewritten:
        consumer = "cross" if item.op == "ikbo::attention" else item.node.split(" ")[0]
        # dynamo names an input x l_x_
        mappings[consumer] = re.sub(r"\bl_(\w+)_\b", r"\1", item.mapping)
    return mappings


def assert_user_rows_copied_to_vendors_only(report):
    """The one gather left is x_u to the vendors: the vendor-level operand
    of the candidate MLP's ikbo linear, beside the vendor features."""
    (left,) = report.left
    assert "group-level operand of ikbo.linear.default" in left.reason, report
    assert "copied to the groups, not to the candidates" in left.reason, report


@pytest.mark.parametrize("composed_index", [False, True], ids=["chained", "composed"])
def test_multi_level_broadcasts_are_rewritten(composed_index):
    model = MultiLevel(composed_index).eval()
    rewritten = rewrite.optimize(model, multi_level_request(), verbose=False)
    report = rewritten.ikbo_report
    assert_user_rows_copied_to_vendors_only(report)
    assert multi_level_mappings(report) == MULTI_LEVEL_MAPPINGS, report
    assert ikbo_ops(rewritten) == ["ikbo.attention.default"] + ["ikbo.linear.default"] * 2
    # Every history row is read by the attention op, none copied per vendor,
    # and the op composes the levels itself: no composed index in the graph.
    assert not gathers_by(rewritten, "history"), rewritten.graph
    (attention,) = (
        n for n in rewritten.graph.nodes if n.target == torch.ops.ikbo.attention.default
    )
    assert attention.args[3].name == "cand_to_vendor", rewritten.graph
    assert [level.name for level in attention.args[-1]] == ["vendor_to_user"], rewritten.graph
    assert len(gathers_by(rewritten, "vendor_to_user")) == 1, rewritten.graph  # x_u[vendor_to_user]
    other = multi_level_request(1, vendors=(1, 1, 0, 3, 2), candidates=(4, 4, 0, 2, 2, 2, 1))
    assert_same_outputs(rewritten, model, other)


def test_multi_level_broadcasts_are_rewritten_under_torch_compile():
    model = MultiLevel(composed_index=False).eval()
    requests = [
        multi_level_request(),
        multi_level_request(1, vendors=(1, 1, 0, 3, 2), candidates=(4, 4, 0, 2, 2, 2, 1)),
        multi_level_request(2, vendors=(0, 0), candidates=(1, 0, 1)),
    ]
    for report in run_compiled(model, requests, dynamic=None):
        assert_user_rows_copied_to_vendors_only(report)
        mappings = multi_level_mappings(report)
        assert sorted(mappings.values()) == sorted(MULTI_LEVEL_MAPPINGS.values()), report


@requires_torch_cuda(torch)
def test_multi_level_broadcasts_on_cuda_in_half_precision():
    model = MultiLevel(composed_index=False).eval().to("cuda", torch.float16)

    def on_cuda(request):
        return tuple(x.cuda().half() if x.is_floating_point() else x.cuda() for x in request)

    rewritten = rewrite.optimize(model, on_cuda(multi_level_request()), verbose=False)
    assert multi_level_mappings(rewritten.ikbo_report) == MULTI_LEVEL_MAPPINGS
    compiled = torch.compile(model, backend=rewrite.make_backend(verbose=False))
    other = on_cuda(multi_level_request(1, vendors=(1, 1, 0, 3, 2), candidates=(4, 0, 2, 2, 1)))
    with torch.no_grad():
        for got in (rewritten(*other), compiled(*other)):
            for actual, expected in zip(got, model(*other)):
                torch.testing.assert_close(actual, expected, rtol=2e-3, atol=2e-3)


class ThreeLevels(torch.nn.Module):
    """SDPA over K and V broadcast through three levels, K by chained
    gathers and V by a composed index and one more gather."""

    def forward(self, q, k_u, v_u, a, b, c):
        k = k_u[a][b][c]
        v = v_u[a[b]][c]
        return F.scaled_dot_product_attention(q, k, v)


def test_three_level_broadcasts_compose_into_one_mapping():
    generator = torch.Generator().manual_seed(5)
    a, b, c = torch.tensor([1, 0, 1]), torch.tensor([2, 0, 0, 1]), torch.tensor([3, 3, 0, 2, 1])
    inputs = (
        torch.randn(5, 2, 3, 64, generator=generator),
        torch.randn(2, 2, 9, 64, generator=generator),
        torch.randn(2, 2, 9, 64, generator=generator),
        a,
        b,
        c,
    )
    rewritten = rewrite.optimize(ThreeLevels(), inputs, verbose=False)
    report = rewritten.ikbo_report
    (item,) = report.rewritten
    assert item.op == "ikbo::attention" and item.mapping == "cand_to_user = a[b][c]", report
    assert not report.left, report
    assert_matches(rewritten, ThreeLevels(), inputs)


class SelectedThroughTwoLevels(torch.nn.Module):
    """SDPA over K and V broadcast by ``index_select`` twice."""

    def forward(self, q, k_u, v_u, vendor_to_user, cand_to_vendor):
        k = k_u.index_select(0, vendor_to_user).index_select(0, cand_to_vendor)
        v = torch.index_select(torch.index_select(v_u, 0, vendor_to_user), 0, cand_to_vendor)
        return F.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("graph", ["symbolic_trace", "torch.export"])
def test_two_levels_of_index_select_compose(graph):
    generator = torch.Generator().manual_seed(37)
    inputs = (
        torch.randn(6, 2, 3, 64, generator=generator),
        torch.randn(3, 2, 8, 64, generator=generator),
        torch.randn(3, 2, 8, 64, generator=generator),
        torch.tensor([1, 1, 0, 2]),
        torch.tensor([3, 0, 3, 2, 1, 3]),
    )
    model = SelectedThroughTwoLevels()
    rewritten = rewrite.optimize(traced_or_exported(model, inputs, graph), inputs, verbose=False)
    (item,) = rewritten.ikbo_report.rewritten
    assert item.op == "ikbo::attention" and not rewritten.ikbo_report.left, rewritten.ikbo_report
    assert item.mapping == "cand_to_user = vendor_to_user[cand_to_vendor]"
    assert_matches(rewritten, model, inputs)


class MixedSpellings(torch.nn.Module):
    """Two user tensors broadcast through the same levels, one by chained
    gathers and one by the composed index, multiplied, then a linear over
    the product beside candidate features."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(41)
        self.linear = torch.nn.Linear(4 + 3, 5)

    def forward(self, x_u, y_u, x_c, vendor_to_user, cand_to_vendor):
        product = x_u[vendor_to_user][cand_to_vendor] * y_u[vendor_to_user[cand_to_vendor]]
        return self.linear(torch.cat([product, x_c], -1))


def test_the_same_levels_spelled_differently_meet_in_one_op():
    generator = torch.Generator().manual_seed(43)

    def request(candidates):
        return (
            torch.randn(3, 4, generator=generator),
            torch.randn(3, 4, generator=generator),
            torch.randn(len(candidates), 3, generator=generator),
            torch.tensor([2, 0, 2, 1]),
            torch.tensor(candidates),
        )

    model = MixedSpellings().eval()
    rewritten = rewrite.optimize(model, request([3, 0, 0, 2, 1, 3]), verbose=False)
    report = rewritten.ikbo_report
    (item,) = report.rewritten
    assert item.op == "ikbo::linear" and not report.left, report
    assert item.mapping == "cand_to_user = vendor_to_user[cand_to_vendor]"
    assert item.moved == ["mul"], item
    assert_matches(rewritten, model, request([1, 1, 3, 0, 2, 2, 0]))
    requests = [request([3, 0, 0, 2, 1, 3]), request([1, 1, 3, 0, 2, 2, 0]), request([0, 2, 1])]
    for report in run_compiled(model, requests, dynamic=None):
        assert [item.op for item in report.rewritten] == ["ikbo::linear"], report
        assert not report.left, report


class ProjectedThroughTwoLevels(torch.nn.Module):
    """K/V projections (and an activation) of a history gathered through two
    levels, then SDPA: the ops move above both gathers."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(31)
        self.k = torch.nn.Linear(32, 128)
        self.v = torch.nn.Linear(32, 128)

    def forward(self, q, history, to_group, group_to_user):
        replicated = history[group_to_user][to_group]
        k = self.k(replicated).unflatten(-1, (2, 64)).transpose(1, 2)
        v = self.v(torch.relu(replicated)).unflatten(-1, (2, 64)).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v)


def projected_request(seed, num_candidates):
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(num_candidates, 2, 3, 64, generator=generator),
        torch.randn(3, 10, 32, generator=generator),
        torch.randint(0, 5, (num_candidates,), generator=generator),
        torch.tensor([2, 0, 2, 1, 0]),
    )


def test_ops_between_levels_move_above_both_gathers():
    model = ProjectedThroughTwoLevels().eval()
    rewritten = rewrite.optimize(model, projected_request(0, 8), verbose=False)
    report = rewritten.ikbo_report
    (item,) = report.rewritten
    assert item.mapping == "cand_to_user = group_to_user[to_group]", report
    # Each op told once, as the model names it, though it moved twice.
    assert item.moved == ["k (Linear)", "unflatten", "relu", "v (Linear)", "unflatten_1"], item
    assert not report.left, report
    assert_matches(rewritten, model, projected_request(1, 13))
    for report in run_compiled(
        model, [projected_request(s, n) for s, n in ((2, 8), (3, 21))], None
    ):
        assert [item.op for item in report.rewritten] == ["ikbo::attention"], report
        assert not report.left, report
