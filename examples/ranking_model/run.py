"""The example ranking model before and after ``ikbo.rewrite.optimize``:
end-to-end latency, peak memory and output difference of one request.

    python examples/ranking_model/run.py                  # GPU if present, else CPU
    python examples/ranking_model/run.py --device cpu --json model.json
    python examples/ranking_model/run.py --help

Defaults: B=1024 candidates at ratio 70 (U=15 users). ``--vendors V`` gives
the request a vendor level: each user's candidates come from about V
vendors, and the model is ``VendorRankingModel``, which reaches the
candidates through the vendors. On a GPU the model has
SPEC's reference shapes in fp16 (LCE M=433, N=256, Ku=1178, Kc=866;
attention H=2, D=128, n_seed=64 onto S=2048 history items); on the CPU the
``--small`` widths (about a quarter) in fp32, which run in well under a
minute on two cores.

What is measured, per model (the original and the rewritten one):

- latency: the median of ``--reps`` forward passes (``torch.no_grad``) after
  ``--warmup`` ones, timed by ``ikbo.bench.Timer`` (GPU: CUDA events, L2
  flushed before each pass; CPU: ``perf_counter``). Every pass gets its own
  copy of ``cand_to_user``, made outside the timed region, as a new request
  would: the rewritten model then builds its candidate map (a device-to-host
  read of the mapping) inside each timed pass. The rewritten model's latency
  with the map of an earlier pass reused is shown too, and on a GPU both
  models replayed from a CUDA graph (map reused): eager passes of the
  rewritten model are bound by the host's launch rate, so that row shows
  the GPU's own time, which does not move with the host CPU.
- peak memory: what one forward pass needs above the resident inputs and
  weights. GPU: ``torch.cuda.max_memory_allocated`` minus
  ``memory_allocated`` before the pass (ikbo's plans and maps, a few MB held
  by the library itself outside torch's allocator, are made before and not
  counted). CPU: the process's peak resident set (Linux ``VmHWM``, the
  counter behind ``resource.getrusage``'s ``ru_maxrss``, reset through
  ``/proc/self/clear_refs`` before each pass) minus its resident set before
  the pass, with glibc's free memory returned to the system first
  (``malloc_trim``) and every block of 64 KiB or more mapped afresh
  (``mallopt``), so that a pass cannot hide its peak in memory an earlier
  one left resident. (tracemalloc
  would see none of it: torch and the library allocate outside Python's
  allocator.)
- output difference: the largest absolute difference between the two
  models' scores, and their relative (Frobenius) error.

``--json FILE`` writes ``model`` records in the format of
``shared/DESIGN.md``; the rewritten model's record carries
``end_to_end_speedup`` (original latency / rewritten latency).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

import torch
from model import (
    ATTENTION_LAYERS,
    SMALL_CONFIG,
    SPEC_CONFIG,
    RankingConfig,
    RankingModel,
    VendorRankingModel,
)

import ikbo.rewrite
from ikbo.bench import (
    DTYPES,
    Timer,
    cand_to_user_for,
    candidate_counts,
    default_device,
    device_name,
    dtype_name,
    format_table,
    users_for_ratio,
    write_json,
)

MIB = 1 << 20


def vendor_count(num_candidates: int, ratio: int, vendors_per_user: int) -> int:
    """V of a request with ``vendors_per_user`` vendors per user (at most B)."""
    return min(users_for_ratio(num_candidates, ratio) * vendors_per_user, num_candidates)


def make_request(
    config: RankingConfig,
    num_candidates: int,
    ratio: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    vendors_per_user: int = 0,
) -> tuple[torch.Tensor, ...]:
    """Random inputs of one request, in ``RankingModel.forward``'s order, for
    U = round(B / ratio) users: a sorted mapping with uneven groups (the
    requests of ``ikbo.bench``), int64 as torch indexing makes it. With
    ``vendors_per_user``, in ``VendorRankingModel.forward``'s order: V = U *
    vendors_per_user vendors (at most B), spread over the users and the
    candidates over the vendors as the mapping above spreads candidates."""
    num_users = users_for_ratio(num_candidates, ratio)
    generator = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device, dtype=dtype)

    def mapping(rows: int, groups: int) -> torch.Tensor:
        return cand_to_user_for(candidate_counts(rows, groups), device, torch.int64)

    users = (
        normal(num_users, config.user_features),
        normal(num_users, config.user_embeddings, config.embedding_dim),
        normal(num_users, config.history_length, config.embedding_dim),
    )
    candidates = (
        normal(num_candidates, config.candidate_features),
        normal(num_candidates, config.candidate_embeddings, config.embedding_dim),
    )
    if not vendors_per_user:
        return (*users, *candidates, mapping(num_candidates, num_users))
    num_vendors = vendor_count(num_candidates, ratio, vendors_per_user)
    return (
        *users,
        normal(num_vendors, config.vendor_features),
        *candidates,
        mapping(num_vendors, num_users),
        mapping(num_candidates, num_vendors),
    )


# ---------------------------------------------------------------------------
# Peak memory of one call


class _HostPeakMemory:
    """A call's peak resident memory above the resident set before it (Linux, glibc)."""

    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    FRESH_MAPPING_BYTES = 64 << 10

    def __init__(self) -> None:
        libc = ctypes.CDLL(None)
        if not all(hasattr(libc, name) for name in ("mallopt", "malloc_trim")):
            raise OSError("the C library has no mallopt and malloc_trim (not glibc)")
        for option in (self.M_MMAP_THRESHOLD, self.M_TRIM_THRESHOLD):
            if libc.mallopt(option, self.FRESH_MAPPING_BYTES) != 1:
                raise OSError(f"mallopt({option}, {self.FRESH_MAPPING_BYTES}) failed")
        self._malloc_trim = libc.malloc_trim
        self._reset_peak()  # a system without it fails here, before any measurement

    @staticmethod
    def _reset_peak() -> None:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as clear_refs:
            clear_refs.write("5")  # resets VmHWM to the current resident set

    @staticmethod
    def _status_bytes(field: str) -> int:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # reported in kB
        raise OSError(f"/proc/self/status has no {field}")

    def __call__(self, run: Callable[[], object]) -> int:
        gc.collect()
        # Free blocks still resident (from earlier calls, in every arena)
        # would be reused without growing the resident set: give them back.
        self._malloc_trim(0)
        self._reset_peak()
        resident = self._status_bytes("VmRSS")
        run()
        return self._status_bytes("VmHWM") - resident


def _cuda_peak_memory(run: Callable[[], object]) -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    resident = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - resident


def peak_memory_meter(
    device: torch.device,
) -> tuple[Callable[[Callable[[], object]], int] | None, str]:
    """(a function returning a call's peak memory in bytes above what was
    resident before it, or None where it cannot be measured; the method, or
    why not)."""
    if device.type == "cuda":
        return _cuda_peak_memory, "torch.cuda.max_memory_allocated - memory_allocated before"
    try:
        return _HostPeakMemory(), "Linux VmHWM (reset via /proc/self/clear_refs) - VmRSS before"
    except OSError as error:
        return None, f"not measured: needs Linux /proc and glibc ({error})"


# ---------------------------------------------------------------------------
# The comparison


@dataclass
class Comparison:
    """Both models on one request."""

    report: ikbo.rewrite.RewriteReport
    original_ms: float
    rewritten_ms: float
    rewritten_map_reused_ms: float
    # CUDA-graph replays (GPU only): the GPU's time without the host's.
    original_graph_ms: float | None
    rewritten_graph_ms: float | None
    original_peak_bytes: int | None
    rewritten_peak_bytes: int | None
    memory_method: str
    max_abs_difference: float
    relative_error: float

    @property
    def speedup(self) -> float:
        return self.original_ms / self.rewritten_ms

    @property
    def graph_speedup(self) -> float | None:
        if self.original_graph_ms is None or self.rewritten_graph_ms is None:
            return None
        return self.original_graph_ms / self.rewritten_graph_ms


def capture(forward: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """One forward pass captured in a CUDA graph, and the tensor its replays
    write. The capture follows warm-up passes on a side stream (PyTorch's
    recipe), which also cache the request's candidate map outside it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = forward()
    return graph, output


def graph_replay_ms(forward: Callable[[], torch.Tensor], timer: Timer) -> float:
    """The median time of replaying one forward pass from a CUDA graph.

    Eager passes of the rewritten model are bound by the host at these sizes
    (many small launches after the candidate map's device-to-host read), so
    their time moves with the host CPU; a replay shows the GPU's own time."""
    graph, _ = capture(forward)
    return timer.median_ms(graph.replay)


def compare(
    config: RankingConfig,
    num_candidates: int,
    ratio: int,
    device: torch.device,
    dtype: torch.dtype,
    timer: Timer,
    vendors_per_user: int = 0,
) -> Comparison:
    """Builds the model and a request, rewrites the model, and measures both."""
    model_class = VendorRankingModel if vendors_per_user else RankingModel
    model = model_class(config).to(device, dtype).eval()
    inputs = make_request(
        config, num_candidates, ratio, dtype, device, vendors_per_user=vendors_per_user
    )
    with torch.no_grad():
        rewritten = ikbo.rewrite.optimize(model, inputs, verbose=False)
        original_scores = model(*inputs)
        rewritten_scores = rewritten(*inputs)
    difference = (rewritten_scores.double() - original_scores.double()).abs()
    relative = difference.norm() / original_scores.double().norm()

    def new_request() -> tuple[torch.Tensor, ...]:
        # A new mapping tensor, as every request brings: the rewritten model
        # cannot reuse the candidate map of an earlier pass.
        return (*inputs[:-1], inputs[-1].clone())

    with torch.no_grad():
        original_ms = timer.median_ms(model, new_request)
        rewritten_ms = timer.median_ms(rewritten, new_request)
        rewritten_map_reused_ms = timer.median_ms(lambda: rewritten(*inputs))
        on_gpu = device.type == "cuda"
        original_graph_ms = graph_replay_ms(lambda: model(*inputs), timer) if on_gpu else None
        rewritten_graph_ms = graph_replay_ms(lambda: rewritten(*inputs), timer) if on_gpu else None
        # After the timing: on the CPU the meter changes how glibc allocates.
        memory_meter, memory_method = peak_memory_meter(device)
        original_peak = memory_meter(lambda: model(*inputs)) if memory_meter else None
        rewritten_peak = memory_meter(lambda: rewritten(*inputs)) if memory_meter else None
    return Comparison(
        rewritten.ikbo_report,
        original_ms,
        rewritten_ms,
        rewritten_map_reused_ms,
        original_graph_ms,
        rewritten_graph_ms,
        original_peak,
        rewritten_peak,
        memory_method,
        float(difference.max()),
        float(relative),
    )


def _mib(num_bytes: int | None) -> float | None:
    return None if num_bytes is None else num_bytes / MIB


def _format_mib(num_bytes: int | None) -> str:
    return "-" if num_bytes is None else f"{num_bytes / MIB:.1f}"


def model_records(
    comparison: Comparison,
    config: RankingConfig,
    num_candidates: int,
    ratio: int,
    dtype: torch.dtype,
    vendors_per_user: int = 0,
) -> list[dict]:
    """The ``model`` records of ``shared/DESIGN.md``: one per model."""
    shape_fields = {
        "dtype": dtype_name(dtype),
        "B": num_candidates,
        "ratio": ratio,
        "U": users_for_ratio(num_candidates, ratio),
        "M": config.compressed_embeddings,
        "N": config.embedding_dim,
        "Ku": config.user_embeddings,
        "Kc": config.candidate_embeddings,
        "S": config.history_length,
        "H": config.heads,
        "n_seed": config.seed_tokens,
        "D": config.head_dim,
        "attention": config.attention,
    }
    if vendors_per_user:
        shape_fields["V"] = vendor_count(num_candidates, ratio, vendors_per_user)
        shape_fields["F_v"] = config.vendor_features
    return [
        {
            "suite": "model",
            "variant": "broadcast",
            **shape_fields,
            "median_ms": comparison.original_ms,
            "median_ms_cuda_graph": comparison.original_graph_ms,
            "peak_memory_mib": _mib(comparison.original_peak_bytes),
            "end_to_end_speedup": 1.0,
        },
        {
            "suite": "model",
            "variant": "ikbo",
            **shape_fields,
            "median_ms": comparison.rewritten_ms,
            "median_ms_map_reused": comparison.rewritten_map_reused_ms,
            "median_ms_cuda_graph": comparison.rewritten_graph_ms,
            "cuda_graph_speedup": comparison.graph_speedup,
            "peak_memory_mib": _mib(comparison.rewritten_peak_bytes),
            "end_to_end_speedup": comparison.speedup,
            "max_abs_difference": comparison.max_abs_difference,
            "relative_error": comparison.relative_error,
        },
    ]


def summary_table(comparison: Comparison) -> str:
    rows = [
        [
            "original (broadcast)",
            f"{comparison.original_ms:.3f}",
            _format_mib(comparison.original_peak_bytes),
            "1.00x",
        ],
        [
            "rewritten (ikbo)",
            f"{comparison.rewritten_ms:.3f}",
            _format_mib(comparison.rewritten_peak_bytes),
            f"{comparison.speedup:.2f}x",
        ],
        [
            "rewritten, map reused",
            f"{comparison.rewritten_map_reused_ms:.3f}",
            "",
            f"{comparison.original_ms / comparison.rewritten_map_reused_ms:.2f}x",
        ],
    ]
    if comparison.graph_speedup is not None:
        rows += [
            ["original, CUDA graph", f"{comparison.original_graph_ms:.3f}", "", "1.00x"],
            [
                "rewritten, CUDA graph",
                f"{comparison.rewritten_graph_ms:.3f}",
                "",
                f"{comparison.graph_speedup:.2f}x",
            ],
        ]
    return format_table(["model", "median ms", "peak MiB", "speedup"], rows)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python examples/ranking_model/run.py",
        description="The example ranking model before and after ikbo.rewrite.optimize.",
    )
    parser.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when available)")
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument(
        "--small", action="store_true", help="quarter widths (the CPU default), S=512"
    )
    sizes.add_argument("--spec", action="store_true", help="SPEC's shapes (the GPU default)")
    parser.add_argument("--B", type=int, default=1024, help="candidates (default 1024)")
    parser.add_argument("--ratio", type=int, default=70, help="candidates per user (default 70)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), help="default: fp16 GPU, fp32 CPU")
    parser.add_argument(
        "--attention",
        choices=ATTENTION_LAYERS,
        default="sdpa",
        help="the attention layer: K/V projected per user, gathered, SDPA (default); or "
        "nn.MultiheadAttention on the history replicated to the candidates",
    )
    parser.add_argument(
        "--vendors",
        type=int,
        default=0,
        metavar="V",
        help="a vendor level between users and candidates, about V vendors per user "
        "(VendorRankingModel; default 0: none)",
    )
    parser.add_argument("--reps", type=int, help="timed passes (default: 30 GPU, 5 CPU)")
    parser.add_argument("--warmup", type=int, help="untimed passes first (default: 5 GPU, 1 CPU)")
    parser.add_argument("--json", metavar="FILE", help="write the model records to FILE")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    options = _parser().parse_args(argv)
    device = torch.device(options.device) if options.device else default_device()
    gpu = device.type == "cuda"
    if gpu:
        torch.cuda.set_device(device)
    config = SMALL_CONFIG if options.small or not (gpu or options.spec) else SPEC_CONFIG
    config = replace(config, attention=options.attention)
    dtype = DTYPES[options.dtype or ("fp16" if gpu else "fp32")]
    # End to end, the host's time counts: an eager pass enqueues hundreds
    # of ops (the CUDA-graph replay is what takes the host out).
    timer = Timer(
        device,
        reps=options.reps if options.reps is not None else (30 if gpu else 5),
        warmup=options.warmup if options.warmup is not None else (5 if gpu else 1),
        host_ahead=False,
    )
    if options.vendors < 0:
        raise SystemExit(f"--vendors must be >= 0, got {options.vendors}")
    num_users = users_for_ratio(options.B, options.ratio)
    vendors = (
        f", {vendor_count(options.B, options.ratio, options.vendors)} vendors"
        if options.vendors
        else ""
    )
    print(f"device: {device_name(device)}, {dtype_name(dtype)}, torch {torch.__version__}")
    print(
        f"request: B={options.B} candidates, ratio {options.ratio} (U={num_users} users{vendors})"
    )
    print(f"model: {config}")
    print(f"timing: {timer.method}; median of {timer.reps} passes after {timer.warmup} warm-up\n")

    comparison = compare(config, options.B, options.ratio, device, dtype, timer, options.vendors)
    print(f"{comparison.report}\n")
    print(summary_table(comparison))
    print(f"\npeak memory: above the resident inputs and weights; {comparison.memory_method}")
    print(
        f"scores: max abs difference {comparison.max_abs_difference:.3e}, "
        f"relative error {comparison.relative_error:.3e}"
    )
    if options.json:
        records = model_records(
            comparison, config, options.B, options.ratio, dtype, options.vendors
        )
        settings = {
            "reps": timer.reps,
            "warmup": timer.warmup,
            "timing": timer.method + "; a new cand_to_user tensor per pass",
            "peak_memory": comparison.memory_method,
            "torch": torch.__version__,
            "model": asdict(config),
            "rewrite": str(comparison.report),
        }
        write_json(options.json, device, records, settings)
        print(f"records: {options.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
