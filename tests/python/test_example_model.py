"""examples/ranking_model at tiny sizes: the rewrite pass replaces every
broadcast of the model, written the usual replicate-then-compute way, with
ikbo ops, the rewritten model reproduces the original on new requests, and
run.py's comparison writes valid ``model`` records."""

import dataclasses
import json
import operator
import pathlib
import re
import sys

import pytest

torch = pytest.importorskip(
    "torch", reason="torch is not importable; the example model and the rewrite pass need it"
)
# ikbo's own modules and the example's are imported plainly: one that fails
# to import must fail these tests, not skip them.
from ikbo import bench, rewrite
from reference import requires_torch_cuda

F = torch.nn.functional

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "ranking_model"
sys.path.insert(0, str(EXAMPLE))
import model as model_module
import run as run_module

TINY = model_module.RankingConfig(
    compressed_embeddings=9,
    embedding_dim=16,
    user_embeddings=6,
    candidate_embeddings=10,
    history_length=12,
    heads=2,
    head_dim=64,
    seed_tokens=3,
    user_features=5,
    candidate_features=4,
    user_tower_dim=6,
    compressed_projection_dim=2,
    mlp_dims=(8,),
)
CPU = torch.device("cpu")
# On the scores (|score| < 0.5 here): both models round to the dtype after
# every layer, in different places (ikbo ops sum their partials in fp32), so
# they differ by a few units in the last place.
TOLERANCE = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def tiny_model(dtype, attention="sdpa"):
    torch.manual_seed(0)
    config = dataclasses.replace(TINY, attention=attention)
    return model_module.RankingModel(config).to(CPU, dtype).eval()


def broadcasts_of(graph_module):
    """Nodes that gather rows by the mapping: ``x[cand_to_user]``, ``index_select``."""
    mapping = next(node for node in graph_module.graph.nodes if node.name == "cand_to_user")
    gathers = (operator.getitem, torch.index_select, "index_select")
    return [node for node in mapping.users if node.target in gathers]


# What the original replicates: user embeddings, keys and values (or the
# history nn.MultiheadAttention projects per candidate), user tower output.
BROADCASTS = {"sdpa": 4, "mha": 3}


@pytest.mark.parametrize("attention", model_module.ATTENTION_LAYERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rewrite_replaces_every_broadcast(dtype, attention, capsys):
    model = tiny_model(dtype, attention)
    original_broadcasts = broadcasts_of(torch.fx.symbolic_trace(model))
    assert len(original_broadcasts) == BROADCASTS[attention]

    inputs = run_module.make_request(TINY, 11, 4, dtype, CPU)
    with torch.no_grad():
        rewritten = rewrite.optimize(model, inputs)
    report = rewritten.ikbo_report
    assert report.left == []
    assert sorted(item.op for item in report.rewritten) == [
        "ikbo::attention",
        "ikbo::lce",
        "ikbo::linear",
    ]
    assert broadcasts_of(rewritten) == []
    assert "3 rewritten, 0 broadcast(s) left" in capsys.readouterr().out

    # Not specialized to the sample request: other sizes and user groups.
    for num_candidates, ratio, seed in ((11, 4, 1), (23, 3, 2), (5, 5, 3)):
        request = run_module.make_request(TINY, num_candidates, ratio, dtype, CPU, seed=seed)
        with torch.no_grad():
            expected, actual = model(*request), rewritten(*request)
        assert actual.shape == expected.shape == (num_candidates,)
        torch.testing.assert_close(actual, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


class GatherFirstModel(model_module.RankingModel):
    """The example model with its user-side layers written after the
    replication, as recsys code often is: the history is replicated to the
    candidates and projected to K and V per candidate, and the user tower runs
    per candidate. Same parameters, same scores."""

    def forward(
        self,
        user_features,
        user_embeddings,
        user_history,
        candidate_features,
        candidate_embeddings,
        cand_to_user,
    ):
        heads, head_dim = self.config.heads, self.config.head_dim
        user_repr = self.user_tower(user_features[cand_to_user])  # [B, user_tower_dim]
        history = user_history[cand_to_user]  # [B, S, N]
        keys = self.key(history).unflatten(-1, (heads, head_dim)).transpose(1, 2)
        values = self.value(history).unflatten(-1, (heads, head_dim)).transpose(1, 2)

        stacked = torch.cat([user_embeddings[cand_to_user], candidate_embeddings], dim=1)
        compressed = torch.matmul(self.compression, stacked)
        seeds = compressed[:, : self.config.seed_tokens]
        queries = self.query(seeds).unflatten(-1, (heads, head_dim)).transpose(1, 2)
        attended = F.scaled_dot_product_attention(queries, keys, values)
        attention_summary = self.attention_norm(attended.mean(dim=2).flatten(1))
        features = torch.cat(
            [
                user_repr,
                candidate_features,
                self.compressed_projection(compressed).flatten(1),
                attention_summary,
            ],
            dim=-1,
        )
        return self.mlp(features).squeeze(-1)


def test_gather_first_model_gets_the_same_rewrites(capsys):
    original = tiny_model(torch.float32)
    model = GatherFirstModel(TINY).eval()
    model.load_state_dict(original.state_dict())
    inputs = run_module.make_request(TINY, 11, 4, torch.float32, CPU)
    with torch.no_grad():
        rewritten = rewrite.optimize(model, inputs)
    report = rewritten.ikbo_report
    assert report.left == []
    moved = {item.op: item.moved for item in report.rewritten}
    assert sorted(moved) == ["ikbo::attention", "ikbo::lce", "ikbo::linear"]
    assert moved["ikbo::attention"] == [
        "key (Linear)",
        "unflatten",
        "value (Linear)",
        "unflatten_1",
    ]
    assert moved["ikbo::linear"] == ["user_tower_0 (Linear)", "user_tower_1 (ReLU)"]
    assert moved["ikbo::lce"] == []
    # The model as written, K/V projected per user: nothing to move.
    plain = rewrite.optimize(original, inputs, verbose=False).ikbo_report
    assert [item.moved for item in plain.rewritten] == [[], [], []]
    assert broadcasts_of(rewritten) == []
    assert "3 rewritten, 0 broadcast(s) left" in capsys.readouterr().out
    for num_candidates, ratio, seed in ((11, 4, 1), (23, 3, 2)):
        request = run_module.make_request(
            TINY, num_candidates, ratio, torch.float32, CPU, seed=seed
        )
        with torch.no_grad():
            expected, actual = original(*request), rewritten(*request)
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_unsorted_mapping():
    model = tiny_model(torch.float32)
    inputs = run_module.make_request(TINY, 13, 4, torch.float32, CPU)
    with torch.no_grad():
        rewritten = rewrite.optimize(model, inputs, verbose=False)
        order = torch.randperm(13, generator=torch.Generator().manual_seed(5))
        shuffled = (*inputs[:-1], inputs[-1][order])
        torch.testing.assert_close(rewritten(*shuffled), model(*shuffled))


def test_comparison_and_model_records():
    timer = bench.Timer(CPU, reps=2, warmup=0)
    comparison = run_module.compare(TINY, 17, 4, CPU, torch.float32, timer)
    assert len(comparison.report.rewritten) == 3 and not comparison.report.left
    assert comparison.max_abs_difference < 1e-4 and comparison.relative_error < 1e-5
    assert comparison.original_ms > 0 and comparison.rewritten_ms > 0
    assert comparison.speedup == pytest.approx(comparison.original_ms / comparison.rewritten_ms)

    records = run_module.model_records(comparison, TINY, 17, 4, torch.float32)
    assert [record["variant"] for record in records] == ["broadcast", "ikbo"]
    for record in records:
        assert record["suite"] == "model" and record["B"] == 17 and record["U"] == 4
        assert record["median_ms"] > 0 and record["end_to_end_speedup"] > 0
    assert records[1]["end_to_end_speedup"] == pytest.approx(comparison.speedup)
    # CUDA-graph replays are a GPU measurement only.
    assert comparison.original_graph_ms is None and comparison.graph_speedup is None
    assert records[1]["median_ms_cuda_graph"] is None


requires_cuda = requires_torch_cuda(torch)


@pytest.mark.parametrize("attention", model_module.ATTENTION_LAYERS)
@pytest.mark.parametrize(
    ("device", "dtype"),
    [("cpu", torch.float32), pytest.param("cuda", torch.float16, marks=requires_cuda)],
)
def test_torch_compile_serves_every_request_size(device, dtype, attention):
    """The model compiled with the ikbo backend (torch's default, automatic
    dynamic shapes): a static graph for the first request, then one graph
    with symbolic B and U for every later size, both rewritten."""
    model = tiny_model(dtype, attention).to(device)
    # Dynamo keeps what it learned of forward's sizes across models: start afresh.
    torch._dynamo.reset()
    reports = []
    compiled = torch.compile(
        model, backend=rewrite.make_backend(verbose=False, on_report=reports.append)
    )
    # No B or U equal to a layer width: dynamo would give them one symbol.
    for seed, (num_candidates, ratio) in enumerate(((21, 3), (33, 3), (39, 3), (43, 3))):
        request = run_module.make_request(
            TINY, num_candidates, ratio, dtype, torch.device(device), seed=seed
        )
        with torch.no_grad():
            expected, actual = model(*request), compiled(*request)
        torch.testing.assert_close(actual, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    assert len(reports) == 2
    for report in reports:
        assert not report.left
        assert sorted(item.op for item in report.rewritten) == [
            "ikbo::attention",
            "ikbo::lce",
            "ikbo::linear",
        ]


@requires_cuda
def test_cuda_graph_replay_matches_eager_passes():
    device = torch.device("cuda")
    model = tiny_model(torch.float16).to(device)
    inputs = run_module.make_request(TINY, 17, 4, torch.float16, device)
    with torch.no_grad():
        rewritten = rewrite.optimize(model, inputs, verbose=False)
        eager = rewritten(*inputs)
        timer = bench.Timer(device, reps=3, warmup=1)
        assert run_module.graph_replay_ms(lambda: rewritten(*inputs), timer) > 0
        # A replay recomputes the captured pass on the same inputs.
        graph, captured = run_module.capture(lambda: rewritten(*inputs))
        captured.fill_(float("nan"))
        graph.replay()
        torch.testing.assert_close(captured, eager)


@pytest.mark.parametrize("attention", model_module.ATTENTION_LAYERS)
def test_command_line_writes_records(tmp_path, capsys, attention):
    path = tmp_path / "model.json"
    arguments = ["--device", "cpu", "--small", "--B", "48", "--ratio", "8", "--reps", "1"]
    arguments += ["--attention", attention]
    assert run_module.main([*arguments, "--warmup", "0", "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "3 rewritten, 0 broadcast(s) left" in printed and "rewritten (ikbo)" in printed
    document = json.loads(path.read_text())
    assert {"device", "date", "commit", "settings", "records"} <= document.keys()
    assert document["settings"]["model"]["attention"] == attention
    broadcast, ikbo_record = document["records"]
    assert (broadcast["variant"], ikbo_record["variant"]) == ("broadcast", "ikbo")
    assert broadcast["attention"] == ikbo_record["attention"] == attention
    assert ikbo_record["end_to_end_speedup"] == pytest.approx(
        broadcast["median_ms"] / ikbo_record["median_ms"]
    )
    if broadcast["peak_memory_mib"] is not None:
        # K and V replicated to 48 candidates alone take 25 MiB at the small widths.
        assert broadcast["peak_memory_mib"] > ikbo_record["peak_memory_mib"]


# Requests of three levels, user -> vendor -> candidate.
VENDOR_MAPPINGS = {
    # User tensors read once per user, by the composed mapping.
    "ikbo::lce": "cand_to_user = vendor_to_user[cand_to_vendor]",
    "ikbo::attention": "cand_to_user = vendor_to_user[cand_to_vendor]",
    # The user tower's output beside the vendor features: from the vendors.
    "ikbo::linear": "cand_to_user = cand_to_vendor",
}


def assert_vendor_rewrites(report):
    assert {item.op: item.mapping for item in report.rewritten} == VENDOR_MAPPINGS, report
    (left,) = report.left  # the user tower's output, copied to the vendors only
    assert "group-level operand of ikbo.linear.default" in left.reason, report


@pytest.mark.parametrize("attention", model_module.ATTENTION_LAYERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vendor_model_is_rewritten_through_both_levels(dtype, attention):
    torch.manual_seed(0)
    config = dataclasses.replace(TINY, attention=attention, vendor_features=3)
    model = model_module.VendorRankingModel(config).to(CPU, dtype).eval()
    inputs = run_module.make_request(config, 23, 6, dtype, CPU, vendors_per_user=3)
    assert [tuple(x.shape) for x in inputs[-3:]] == [(23, 10, 16), (12,), (23,)]
    with torch.no_grad():
        rewritten = rewrite.optimize(model, inputs, verbose=False)
    assert_vendor_rewrites(rewritten.ikbo_report)
    for num_candidates, ratio, vendors, seed in ((11, 4, 2, 1), (30, 3, 5, 2), (5, 5, 1, 3)):
        request = run_module.make_request(
            config, num_candidates, ratio, dtype, CPU, seed=seed, vendors_per_user=vendors
        )
        with torch.no_grad():
            expected, actual = model(*request), rewritten(*request)
        torch.testing.assert_close(actual, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize(
    ("device", "dtype"),
    [("cpu", torch.float32), pytest.param("cuda", torch.float16, marks=requires_cuda)],
)
def test_vendor_model_under_torch_compile(device, dtype):
    torch.manual_seed(0)
    config = dataclasses.replace(TINY, vendor_features=3)
    model = model_module.VendorRankingModel(config).to(device, dtype).eval()
    torch._dynamo.reset()
    reports = []
    compiled = torch.compile(
        model, backend=rewrite.make_backend(verbose=False, on_report=reports.append)
    )
    for seed, (num_candidates, vendors) in enumerate(((21, 2), (33, 3), (43, 2))):
        request = run_module.make_request(
            config, num_candidates, 3, dtype, torch.device(device), seed, vendors
        )
        with torch.no_grad():
            expected, actual = model(*request), compiled(*request)
        torch.testing.assert_close(actual, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    assert len(reports) == 2
    for report in reports:
        # dynamo names an input x l_x_
        for item in report.rewritten:
            item.mapping = re.sub(r"\bl_(\w+)_\b", r"\1", item.mapping)
        assert_vendor_rewrites(report)


def test_command_line_with_vendors_writes_records(tmp_path, capsys):
    path = tmp_path / "model.json"
    arguments = ["--device", "cpu", "--small", "--B", "48", "--ratio", "8", "--vendors", "3"]
    assert run_module.main([*arguments, "--reps", "1", "--warmup", "0", "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "U=6 users, 18 vendors" in printed and "3 rewritten, 1 broadcast(s) left" in printed
    broadcast, ikbo_record = json.loads(path.read_text())["records"]
    assert broadcast["V"] == ikbo_record["V"] == 18
    assert ikbo_record["relative_error"] < 1e-5
