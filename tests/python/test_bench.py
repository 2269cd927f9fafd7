"""python -m ikbo.bench at tiny sizes on the CPU: every variant is checked and
timed, the tables print, the JSON records follow shared/DESIGN.md, plots are
drawn or skipped with a reason; plus the synthetic requests and the output
check that rejects a wrong variant."""

import json
import time

import pytest

torch = pytest.importorskip(
    "torch", reason="torch is not importable; the Python bench compares against PyTorch"
)
from ikbo import bench  # after torch's check; a failing import must fail

TINY_ARGUMENTS = [
    "--device", "cpu", "--B", "16,24", "--ratio", "4", "--S", "32,48",
    "--lce-dims", "5,8,6,10", "--attention-dims", "1,4,64", "--linear-dims", "7,6,10",
    "--reps", "2", "--warmup", "0",
]  # fmt: skip
LCE_VARIANTS = ["broadcast", "broadcast+copy", "decomposed", "aligned", "ikbo"]
ATTENTION_VARIANTS = ["sdpa-flash", "sdpa-flash+copy", "packed-flash", "ikbo"]
LINEAR_VARIANTS = ["broadcast", "broadcast+copy", "decomposed", "ikbo"]


def test_all_suites_end_to_end(tmp_path, capsys):
    path, plots = tmp_path / "bench.json", tmp_path / "plots"
    assert bench.main(["all", *TINY_ARGUMENTS, "--json", str(path), "--plot", str(plots)]) == 0
    printed = capsys.readouterr().out
    assert "LCE staircase at B=16, ratio 4" in printed and "Attention, H=1" in printed
    assert "Linear variants at B=16, ratio 4" in printed

    document = json.loads(path.read_text())
    assert {"device", "date", "commit", "backend", "settings", "ceilings", "records"} <= set(
        document
    )
    assert document["backend"] == "cpu" and document["not_measured"] == []
    assert "rounded once to the dtype" in document["settings"]["inputs"]
    assert document["ceilings"]["matmul_tflops"] > 0 and document["ceilings"]["bandwidth_gbps"] > 0
    records = document["records"]
    lce = [record for record in records if record["suite"] == "lce"]
    attention = [record for record in records if record["suite"] == "attention"]
    linear = [record for record in records if record["suite"] == "linear"]
    assert [record["variant"] for record in lce] == LCE_VARIANTS * 2
    assert [record["variant"] for record in attention] == ATTENTION_VARIANTS * 4
    assert [record["variant"] for record in linear] == LINEAR_VARIANTS * 2
    for record in records:
        assert record["dtype"] == "fp32" and record["ratio"] == 4
        for key in ("median_ms", "tflops", "gbps", "floor_ms", "pct_of_floor"):
            assert record[key] > 0, key
        assert 0 < record["min_ms"] <= record["median_ms"] <= record["max_ms"]
        assert record["speedup_vs_broadcast"] > 0 and record["speedup_vs_broadcast_copy"] > 0
    assert {(r["B"], r["U"], r["M"], r["N"], r["Ku"], r["Kc"]) for r in lce} == {
        (16, 4, 5, 8, 6, 10),
        (24, 6, 5, 8, 6, 10),
    }
    assert {(r["B"], r["S"], r["H"], r["n_seed"], r["D"]) for r in attention} == {
        (b, s, 1, 4, 64) for b in (16, 24) for s in (32, 48)
    }
    assert {(r["B"], r["U"], r["N_out"], r["Ku"], r["Kc"]) for r in linear} == {
        (16, 4, 7, 6, 10),
        (24, 6, 7, 6, 10),
    }
    for suite, variants in (
        ("lce", LCE_VARIANTS),
        ("attention", ATTENTION_VARIANTS),
        ("linear", LINEAR_VARIANTS),
    ):
        assert list(document["settings"]["variants"][suite]) == variants

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "plots skipped: matplotlib is not importable" in printed
    else:
        expected = {"lce_batch_sweep.png", "lce_staircase.png", "attention_sweep.png"}
        expected |= {"linear_batch_sweep.png", "linear_variants.png"}
        assert expected <= {path.name for path in plots.iterdir()}


def test_single_suite_without_json(capsys):
    assert bench.main(["lce", *TINY_ARGUMENTS]) == 0
    printed = capsys.readouterr().out
    assert "LCE, M=5, N=8, Ku=6, Kc=10, fp32" in printed and "Attention" not in printed


def test_lce_fused_stage_is_a_cuda_variant_before_ikbo():
    assert [variant.name for variant in bench.lce_variants(torch.device("cpu"))] == LCE_VARIANTS
    assert [variant.name for variant in bench.lce_variants(torch.device("cuda", 0))] == [
        *LCE_VARIANTS[:-1],
        "fused",
        "ikbo",
    ]


def test_linear_suite_end_to_end(tmp_path, capsys):
    path = tmp_path / "linear.json"
    arguments = ["linear", *TINY_ARGUMENTS, "--ratio", "1,4,1000", "--json", str(path)]
    assert bench.main(arguments) == 0
    printed = capsys.readouterr().out
    assert "Linear, N_out=7, Ku=6, Kc=10, fp32" in printed
    assert "LCE" not in printed and "Attention" not in printed

    document = json.loads(path.read_text())
    assert document["backend"] == "cpu" and document["not_measured"] == []
    assert "rounded once to the dtype" in document["settings"]["inputs"]
    assert list(document["settings"]["variants"]) == ["linear"]
    records = document["records"]
    assert {record["suite"] for record in records} == {"linear"}
    assert [record["variant"] for record in records] == LINEAR_VARIANTS * 6
    shapes = {(r["B"], r["ratio"], r["U"]) for r in records}
    assert shapes == {
        (b, ratio, bench.users_for_ratio(b, ratio)) for b in (16, 24) for ratio in (1, 4, 1000)
    }
    for record in records:
        assert record["dtype"] == "fp32"
        assert (record["N_out"], record["Ku"], record["Kc"]) == (7, 6, 10)
        flops = 2 * 7 * (record["B"] * 10 + record["U"] * 6)
        assert record["tflops"] == pytest.approx(flops / (record["median_ms"] * 1e9))
        for key in ("median_ms", "gbps", "floor_ms", "pct_of_floor"):
            assert record[key] > 0, key
        assert 0 < record["min_ms"] <= record["median_ms"] <= record["max_ms"]
        assert record["speedup_vs_broadcast"] > 0 and record["speedup_vs_broadcast_copy"] > 0


def test_linear_variants_match_torch():
    shape = bench.LinearShape(B=10, ratio=3, N_out=5, Ku=3, Kc=7)
    work = bench.LinearWorkload.make(shape, torch.device("cpu"), torch.float32)
    expected = torch.nn.functional.linear(
        torch.cat([work.x_u[work.cand_to_user.long()], work.x_c], -1), work.weight, work.bias
    )
    for variant in bench.linear_suite().variants:
        output = variant.prepare(work).run()
        torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5, msg=variant.name)


@pytest.mark.parametrize(
    ("num_candidates", "num_users", "expected"),
    [
        (2048, 32, [63, 65, 64, 64, 63, 65]),  # whole B/U: odd and even counts still occur
        (1024, 15, [68, 68, 68, 69, 68, 68]),  # 1024 / 15 = 68.27: the larger groups spread out
        (7, 3, [2, 2, 3]),
        (3, 3, [1, 1, 1]),
    ],
)
def test_candidate_counts(num_candidates, num_users, expected):
    counts = bench.candidate_counts(num_candidates, num_users)
    assert len(counts) == num_users and sum(counts) == num_candidates
    assert counts[: len(expected)] == expected


def test_users_for_ratio():
    assert bench.users_for_ratio(1024, 70) == 15
    assert bench.users_for_ratio(2048, 64) == 32
    assert bench.users_for_ratio(16, 1000) == 1 and bench.users_for_ratio(4, 1) == 4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_inputs_are_drawn_in_float32_and_rounded_once(dtype):
    # Drawn in the dtype itself, torch.rand's values, mapped to [-1, 1), were
    # 2048 (float16) or 256 (bfloat16) multiples of one power of two.
    drawn = bench._uniform((100_000,), dtype, torch.device("cpu"), seed=5, scale=2.0)
    generator = torch.Generator().manual_seed(5)
    expected = torch.rand(100_000, generator=generator).mul_(4.0).sub_(2.0).to(dtype)
    assert drawn.dtype == dtype and torch.equal(drawn, expected)
    assert drawn.abs().max() <= 2.0
    assert drawn.unique().numel() > (10_000 if dtype == torch.float16 else 1_000)


def test_clock_limit_names():
    assert bench.clock_limit_names(0) == []
    assert bench.clock_limit_names(0x1) == []  # GPU idle: not a limit
    assert bench.clock_limit_names(0x5) == ["power cap"]
    assert bench.clock_limit_names(0x44) == ["power cap", "hw thermal"]


def test_cpu_timer_samples_no_clock():
    timer = bench.Timer(torch.device("cpu"), reps=2, warmup=0)
    assert len(timer.samples_ms(lambda: None)) == 2
    spread = timer.spread_ms(lambda: time.sleep(0.002))
    assert 2 <= spread.min <= spread.median <= spread.max
    assert timer.clock_sampling is None and timer.last_clocks is None
    with pytest.raises(ValueError, match="settle_ms=-1"):
        bench.Timer(torch.device("cpu"), reps=2, warmup=0, settle_ms=-1)


def test_wrong_output_is_reported_not_timed():
    def wrong(work):
        return bench.Prepared(lambda: torch.zeros(work.shape.B, work.shape.M, work.shape.N))

    suite = bench.lce_suite(torch.device("cpu"))
    suite = bench.Suite(
        "lce",
        (*suite.variants[:1], bench.Variant("wrong", "zeros", wrong)),
        suite.broadcast,
        suite.broadcast_copy,
        suite.make_workload,
    )
    timer = bench.Timer(torch.device("cpu"), reps=1, warmup=0)
    ceilings = bench.measure_ceilings(timer, torch.float32)
    shape = bench.LceShape(B=8, ratio=4, M=3, N=4, Ku=5, Kc=6)
    result = bench.run_suite(suite, [shape], torch.float32, timer, ceilings)
    assert [record["variant"] for record in result.records] == ["broadcast"]
    (failure,) = result.not_measured
    assert failure["variant"] == "wrong" and failure["outcome"] == "failed"
    assert "output differs from broadcast's by relative error 1.00e+00" in failure["reason"]
