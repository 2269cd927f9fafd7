"""``python -m ikbo.bench``: the published IKBO tables, with PyTorch baselines.

Times ``ikbo.lce``, ``ikbo.attention`` and ``ikbo.linear`` against what
PyTorch code runs for the same computation, on the CPU or a CUDA GPU::

    python -m ikbo.bench                       # every suite, default shapes for the device
    python -m ikbo.bench lce --json lce.json --plot plots/
    python -m ikbo.bench attention --S 2048,8192 --reps 50
    python -m ikbo.bench linear --B 1024 --ratio 10,100
    python -m ikbo.bench --help

Suites and variants (each variant's ``timed`` text says what one timed run covers):

- ``lce`` -- the optimization staircase at the reference shape (M=433, N=256,
  Ku=1178, Kc=866, B=1024, ratio 70, fp16 on a GPU), a batch sweep
  B in {512, ..., 3072} at ratio 70 and a ratio sweep {2, ..., 1000} at
  B=1024: ``broadcast``, ``broadcast+copy``, ``decomposed``, ``aligned``,
  ``fused`` (CUDA only; skipped, with the reason, where ikbo's Hopper kernel
  does not run) and ``ikbo``.
- ``attention`` -- B=2048, ratio 64, H=2, n_seed=64, D=128 over
  S in {512, ..., 16384}: SDPA on pre-broadcast K/V with each backend
  (``sdpa-flash``, ``sdpa-cudnn``), the fastest with the broadcast copy timed
  (``sdpa-cudnn+copy``), SDPA over per-user packed query blocks
  (``packed-cudnn``), and ``ikbo``. The CPU has no cuDNN backend: there the
  copy and packed variants use SDPA's flash backend.
- ``linear`` -- the first MLP layer of ``examples/ranking_model/model.py``
  (N_out=512 over the user tower's Ku=256 and the candidate side's Kc=3976,
  fp16 on a GPU), a batch sweep B in {512, ..., 3072} at ratio 70 and a ratio
  sweep {2, ..., 1000} at B=1024: ``broadcast``, ``broadcast+copy``,
  ``decomposed``, ``ikbo``.

On the CPU the defaults are scaled down to finish in well under a minute on
two cores (the linear suite in a few seconds). ``--B``, ``--ratio`` and
``--S`` lists are crossed with each other. lce and linear run their default
sweeps unless ``--B`` or ``--ratio`` is given (``--S`` alone leaves them);
given one of the two, the other takes the suite's reference value.
attention takes the reference B and ratio where those lists are not given,
and its S sweep where ``--S`` is not.

Method: every variant's output is checked against that of the shape's first
measured variant (relative Frobenius error within a dtype tolerance) before
it is timed; one that differs is reported as failed, not timed. GPU:
CUDA events around each run, a write over twice the L2 size before each run
(outside the events) so no run finds the previous one's data in cache, and
the SM clock sampled through NVML during the timed runs (``ClockMonitor``:
records gain ``sm_mhz``, ``min_sm_mhz``, ``clock_limits``), after idling
100 ms and then until the driver reports no power or thermal limit on it
(``--settle-ms``; the wait is the records' ``settled_ms``). CPU:
``time.perf_counter``. Both report the median of ``--reps`` runs after
``--warmup`` untimed ones. A request has U = round(B / ratio) users with
candidate counts spread as evenly as possible (where B / U is whole, every
fourth user hands one candidate to the next, so odd and even counts occur),
``cand_to_user`` sorted by user: the same requests as ``ikbo-bench``.

Roofline: the ceilings (a large matmul in the run's dtype and a device copy,
fastest of their runs) are measured first; a shape's floor is
max(FLOPs / matmul ceiling, minimum bytes / copy bandwidth) of the IKBO
useful work, the same for every variant so TFLOP/s compare directly:

- lce: FLOPs = 2*M*N*(B*Kc + U*Ku); bytes = (B*Kc*N + U*Ku*N + M*(Ku+Kc) + B*M*N) * size;
- attention: FLOPs = 4*B*H*n_seed*D*S; bytes = (2*B*n_seed + 2*U*S) * H*D * size;
- linear: FLOPs = 2*N_out*(B*Kc + U*Ku);
  bytes = (B*Kc + U*Ku + N_out*(Ku+Kc) + N_out + B*N_out) * size.

Output: tables on stdout (progress on stderr); ``--plot DIR`` draws PNGs with
matplotlib (skipped, with the reason printed, when it is missing); ``--json
FILE`` writes the record format of the project's design document
(``../shared/DESIGN.md`` beside the checkout, not in this repository). The
timer, request generator and record writer are public for other scripts
(``examples/ranking_model/run.py`` uses them).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import ikbo
from ikbo import _C

__all__ = [
    "DTYPES",
    "Timer",
    "cand_to_user_for",
    "candidate_counts",
    "commit",
    "default_device",
    "device_name",
    "dtype_name",
    "format_table",
    "main",
    "users_for_ratio",
    "write_json",
]

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}

# Relative Frobenius error allowed between a variant and the suite's first
# variant. Both round once to the output dtype (``decomposed`` twice), with
# sums in different orders.
CHECK_TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 4e-2, torch.float32: 1e-4}

# Seeds of the synthetic inputs, one per tensor, so that every run times the
# same values.
_SEED_WEIGHT, _SEED_USER, _SEED_CANDIDATE, _SEED_USER_VALUES, _SEED_BIAS = 1, 2, 3, 4, 5


# ---------------------------------------------------------------------------
# Requests


def users_for_ratio(num_candidates: int, ratio: int) -> int:
    """U for B candidates at B/U ~ ``ratio``: B / ratio rounded half away from
    zero (as ``ikbo-bench`` rounds), at least 1, at most B."""
    return min(max(math.floor(num_candidates / ratio + 0.5), 1), num_candidates)


def candidate_counts(num_candidates: int, num_users: int) -> list[int]:
    """Candidates per user, as even as possible. Group u ends at
    floor((u + 1) * B / U), so larger groups spread out; where every group
    would be equal, every fourth user hands one candidate to the next, so that
    odd and even counts both occur (kernels must not rely on equal groups)."""
    counts = [
        (user + 1) * num_candidates // num_users - user * num_candidates // num_users
        for user in range(num_users)
    ]
    if num_candidates % num_users == 0 and num_candidates // num_users >= 2:
        for user in range(0, num_users - 1, 4):
            counts[user] -= 1
            counts[user + 1] += 1
    return counts


def cand_to_user_for(
    counts: Sequence[int], device: torch.device, dtype: torch.dtype = torch.int32
) -> torch.Tensor:
    """The sorted mapping of a request whose user u has ``counts[u]`` candidates."""
    users = torch.arange(len(counts), dtype=dtype)
    return users.repeat_interleave(torch.tensor(counts)).to(device)


# What a record says of its inputs (``_uniform``), as ikbo-bench's do.
_INPUTS = (
    "uniform in [-1, 1) (weights and bias scaled), drawn in float32, rounded once to the dtype"
)


def _uniform(
    shape: Sequence[int], dtype: torch.dtype, device: torch.device, seed: int, scale: float = 1.0
) -> torch.Tensor:
    """Drawn uniform in [-scale, scale) on ``device`` (fast for the large
    inputs) in float32 and rounded once to ``dtype``, so that every mantissa
    bit varies, as in activations and in ikbo-bench's inputs. (Drawn in
    float16, the values are rounded before the map to [-scale, scale), whose
    subtraction leaves multiples of 2^-11: ~3,000 values on CUDA, 2048 on the
    CPU, their mantissas ending in 2.6-3.0 zero bits on average against 1.0.)"""
    generator = torch.Generator(device=device).manual_seed(seed)
    values = torch.rand(tuple(shape), dtype=torch.float32, device=device, generator=generator)
    return values.mul_(2 * scale).sub_(scale).to(dtype)


# ---------------------------------------------------------------------------
# Timing and environment


def _is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


# nvmlClocksEventReasons bits, by name.
_CLOCK_LIMITS = (
    (0x2, "applications clocks"),
    (0x4, "power cap"),
    (0x8, "hw slowdown"),
    (0x10, "sync boost"),
    (0x20, "sw thermal"),
    (0x40, "hw thermal"),
    (0x80, "power brake"),
    (0x100, "display clocks"),
)


# Of those, the limits that follow from what the GPU ran before (power cap,
# hw slowdown, sw and hw thermal, power brake), which idling clears.
_TRANSIENT_LIMITS = 0x4 | 0x8 | 0x20 | 0x40 | 0x80


def clock_limit_names(reasons: int) -> list[str]:
    """The names of the clock event reasons set in NVML's bit mask ``reasons``
    (GPU idle, 0x1, is not a limit and is left out)."""
    return [name for bit, name in _CLOCK_LIMITS if reasons & bit]


class ClockMonitor:
    """The SM clock of a CUDA device and what held it below its maximum
    (the power cap above all), sampled through NVML (libnvidia-ml, loaded
    with ctypes) on a thread while a variant is timed: a sweep of heavy
    GEMMs draws the board's power limit, and what is timed after them runs
    at lower clocks than the ceilings measured at the start. ``available``
    is False, with ``unavailable_reason``, where NVML cannot be reached."""

    PERIOD_S = 0.002
    MIN_IDLE_MS = 100
    SETTLE_PERIOD_S = 0.01

    def __init__(self, device: torch.device) -> None:
        self._nvml = self._handle = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._mhz: list[int] = []
        self._reasons = 0
        self.unavailable_reason = ""
        try:
            nvml = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError:
            self.unavailable_reason = "libnvidia-ml.so.1 not found"
            return
        reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None
        )
        handle = ctypes.c_void_p()
        properties = torch.cuda.get_device_properties(device)
        bus_id = (
            f"{properties.pci_domain_id:04x}:{properties.pci_bus_id:02x}:"
            f"{properties.pci_device_id:02x}.0"
        )
        required = ("nvmlInit_v2", "nvmlDeviceGetHandleByPciBusId_v2", "nvmlDeviceGetClockInfo")
        if reasons is None or not all(hasattr(nvml, name) for name in required):
            self.unavailable_reason = "libnvidia-ml.so.1 lacks the functions used"
            return
        if nvml.nvmlInit_v2() != 0:
            self.unavailable_reason = "nvmlInit_v2 failed"
            return
        if nvml.nvmlDeviceGetHandleByPciBusId_v2(bus_id.encode(), ctypes.byref(handle)) != 0:
            self.unavailable_reason = f"NVML does not know the device at {bus_id}"
            return
        self._nvml, self._handle, self._reasons_of = nvml, handle, reasons

    @property
    def available(self) -> bool:
        return self._nvml is not None

    def settle(self, max_ms: int) -> int:
        """Idles ``MIN_IDLE_MS`` and then until the driver reports no power
        or thermal limit on the clock (checked every ``SETTLE_PERIOD_S``),
        for at most ``max_ms``; returns the milliseconds waited. The GPU must
        have no work queued. The flag alone is not enough: on H100 it is
        often clear right after a burst at the power limit while the next
        burst still starts throttled (attention at S = 4096 read 629 instead
        of 705 TFLOP/s with no idle; 50 ms restored it every time)."""
        if not self.available:
            return 0
        start = time.perf_counter()
        time.sleep(min(self.MIN_IDLE_MS, max_ms) / 1e3)
        while True:
            waited_ms = round((time.perf_counter() - start) * 1e3)
            limited = (self._current_reasons() or 0) & _TRANSIENT_LIMITS
            if not limited or waited_ms >= max_ms:
                return waited_ms
            time.sleep(self.SETTLE_PERIOD_S)

    def _current_reasons(self) -> int | None:
        """NVML's clock event reasons now, or None if the call failed."""
        reasons = ctypes.c_ulonglong()
        if self._reasons_of(self._handle, ctypes.byref(reasons)) != 0:
            return None
        return reasons.value

    def _sample(self) -> None:
        mhz = ctypes.c_uint()
        if self._nvml.nvmlDeviceGetClockInfo(self._handle, 1, ctypes.byref(mhz)) == 0:  # SM
            self._mhz.append(mhz.value)
        self._reasons |= self._current_reasons() or 0

    def start(self) -> None:
        if not self.available:
            return
        self.stop()
        self._mhz, self._reasons = [], 0
        self._stop.clear()

        def sample_until_stopped() -> None:
            while not self._stop.is_set():
                self._sample()
                self._stop.wait(self.PERIOD_S)

        self._thread = threading.Thread(target=sample_until_stopped, daemon=True)
        self._thread.start()

    def stop(self) -> dict | None:
        """Ends sampling: ``{"sm_mhz", "min_sm_mhz", "clock_limits"}`` of the
        samples taken, or None."""
        if self._thread is None:
            return None
        self._stop.set()
        self._thread.join()
        self._thread = None
        self._sample()
        if not self._mhz:
            return None
        return {
            "sm_mhz": statistics.median(self._mhz),
            "min_sm_mhz": min(self._mhz),
            "clock_limits": clock_limit_names(self._reasons),
        }


class Spread(NamedTuple):
    """The median, fastest and slowest of a series of timed runs, in ms."""

    median: float
    min: float
    max: float


class Timer:
    """Times a callable: the median, fastest and slowest of ``reps`` runs
    after ``warmup`` untimed ones. On a GPU each run is bracketed by CUDA events on
    the current stream, after a write over twice the L2 size that evicts
    the previous run's data; the warm-up and the timed runs are queued
    behind a GPU wait (``HEAD_START_CYCLES``) that keeps the host's
    enqueueing out of the events (``host_ahead``); before the warm-up
    the timer idles ``ClockMonitor.MIN_IDLE_MS`` and then until the driver
    reports no power or thermal limit on the clock (at most ``settle_ms``),
    so each variant starts from the same state rather than from what the one
    before it left; the SM clock is sampled during the timed runs
    (``last_clocks``). On the CPU runs are timed with ``perf_counter``."""

    def __init__(
        self,
        device: torch.device,
        reps: int,
        warmup: int,
        settle_ms: int = 2000,
        host_ahead: bool = True,
    ) -> None:
        """``host_ahead``: queue the runs behind the GPU wait, so that the
        events time the GPU only; False times what the host adds too (e.g. an
        eager model's end-to-end latency)."""
        if reps < 1 or warmup < 0 or settle_ms < 0:
            raise ValueError(
                "reps must be >= 1 and warmup and settle_ms >= 0, got "
                f"reps={reps}, warmup={warmup}, settle_ms={settle_ms}"
            )
        self.device, self.reps, self.warmup = device, reps, warmup
        self.settle_ms, self.host_ahead = settle_ms, host_ahead
        self._l2_flush = None
        self._clocks: ClockMonitor | None = None
        self.last_clocks: dict | None = None
        if _is_cuda(device):
            l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
            self._l2_flush = torch.empty(2 * l2_bytes, dtype=torch.uint8, device=device)
            self._clocks = ClockMonitor(device)

    @property
    def clock_sampling(self) -> str | None:
        """How the SM clock is sampled, or why not (None on the CPU)."""
        if self._clocks is None:
            return None
        if not self._clocks.available:
            return f"SM clock not sampled: {self._clocks.unavailable_reason}"
        period_ms = round(ClockMonitor.PERIOD_S * 1e3)
        sampling = (
            f"SM clock and its limits (NVML) sampled every {period_ms} ms during the timed runs"
        )
        if self.settle_ms > 0:
            sampling += (
                f"; before each variant, idle {ClockMonitor.MIN_IDLE_MS} ms and then until no "
                f"power or thermal limit (at most {self.settle_ms} ms)"
            )
        return sampling

    # GPU clock cycles (torch.cuda._sleep; ~20 ms at 1980 MHz) the warm-up
    # and the timed runs are queued behind. A Python op takes tens of
    # microseconds of the host's time to enqueue; where that exceeds what
    # the GPU has queued, a small op's events time the host (the linear
    # suite read 0.0445 ms in C++ and 0.397 ms here at one shape), and a
    # pause of the host (the interpreter switching to the clock sampler's
    # thread, a garbage collection) drains the queue. The wait lets the host
    # queue the whole series first. Until session 32 each run also waited
    # 200,000 cycles before its flush: that idle cost a kernel after it up to
    # 2.7% (C++ bench, attention at S = 512), where the C++ bench's runs
    # follow each other.
    HEAD_START_CYCLES = 40_000_000

    @property
    def method(self) -> str:
        if self._l2_flush is None:
            return "time.perf_counter"
        if not self.host_ahead:
            return "CUDA events, L2 flushed before every run"
        return (
            "CUDA events, L2 flushed before every run, the warm-up and the runs queued "
            f"behind a {self.HEAD_START_CYCLES}-cycle GPU wait so that the host's time is "
            "not timed"
        )

    def samples_ms(
        self, run: Callable[..., Any], before_each: Callable[[], tuple] | None = None
    ) -> list[float]:
        """Milliseconds of each timed run of ``run(*before_each())``;
        ``before_each`` (untimed) makes fresh arguments for every run."""

        def arguments() -> tuple:
            return before_each() if before_each is not None else ()

        settled_ms = 0
        if self._clocks is not None and self.settle_ms > 0:
            torch.cuda.synchronize(self.device)
            settled_ms = self._clocks.settle(self.settle_ms)
        gpu = self._l2_flush is not None
        if gpu and self.host_ahead:
            torch.cuda._sleep(self.HEAD_START_CYCLES)
        for _ in range(self.warmup):
            run(*arguments())
        if not gpu:
            samples = []
            for _ in range(self.reps):
                args = arguments()
                start = time.perf_counter()
                run(*args)
                samples.append((time.perf_counter() - start) * 1e3)
            return samples
        # The clock is sampled while the timed runs run: from when the GPU
        # reaches them (host_ahead: once the warm-up is done), else from
        # their enqueueing.
        warmed_up = None
        if self.host_ahead:
            warmed_up = torch.cuda.Event()
            warmed_up.record()
        else:
            self._clocks.start()
        events = []
        try:
            for _ in range(self.reps):
                args = arguments()
                self._l2_flush.zero_()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                run(*args)
                end.record()
                events.append((start, end))
            if warmed_up is not None:
                warmed_up.synchronize()
                self._clocks.start()
            torch.cuda.synchronize(self.device)
        finally:
            self.last_clocks = self._clocks.stop()
            if self.last_clocks is not None:
                self.last_clocks["settled_ms"] = settled_ms
        return [start.elapsed_time(end) for start, end in events]

    def spread_ms(
        self, run: Callable[..., Any], before_each: Callable[[], tuple] | None = None
    ) -> Spread:
        """The median, fastest and slowest of the timed runs."""
        samples = self.samples_ms(run, before_each)
        return Spread(statistics.median(samples), min(samples), max(samples))

    def median_ms(
        self, run: Callable[..., Any], before_each: Callable[[], tuple] | None = None
    ) -> float:
        return self.spread_ms(run, before_each).median


def device_name(device: torch.device) -> str:
    if _is_cuda(device):
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def commit() -> str:
    """``$IKBO_COMMIT``, else the short hash of the git checkout in the
    working directory, else ``"unknown"``."""
    if os.environ.get("IKBO_COMMIT"):
        return os.environ["IKBO_COMMIT"]
    try:
        result = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return result.stdout.strip() if result.returncode == 0 else "unknown"


def dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, value in DTYPES.items() if value == dtype)


def _backend_name(device: torch.device) -> str:
    return f"cuda:{device.index or 0}" if _is_cuda(device) else "cpu"


def write_json(
    path: str,
    device: torch.device,
    records: list[dict],
    settings: dict,
    ceilings: dict | None = None,
    not_measured: Sequence[dict] = (),
) -> None:
    """Writes the record document of the project's ``../shared/DESIGN.md``
    (beside the checkout) to ``path``."""
    document = {
        "device": device_name(device),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": commit(),
        "backend": _backend_name(device),
        "settings": settings,
    }
    if ceilings is not None:
        document["ceilings"] = ceilings
    document["records"] = records
    document["not_measured"] = list(not_measured)
    with open(path, "w", encoding="utf-8") as file:
        json.dump(document, file, indent=1)
        file.write("\n")


def _numeric(text: str) -> bool:
    try:
        float(text.rstrip("x%"))
    except ValueError:
        return text in ("", "-")
    return True


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table, columns padded to line up in a terminal: numbers
    (speedups like ``2.5x`` and percentages included) right-aligned, text left."""
    cells = [[str(value) for value in row] for row in [headers, *rows]]
    columns = range(len(headers))
    widths = [max(len(row[column]) for row in cells) for column in columns]
    right = [all(_numeric(row[column]) for row in cells[1:]) for column in columns]

    def line(row: Sequence[str]) -> str:
        padded = (
            value.rjust(width) if align_right else value.ljust(width)
            for value, width, align_right in zip(row, widths, right)
        )
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join("-" * (w + 1) + (":" if r else "-") for w, r in zip(widths, right)) + "|"
    return "\n".join([line(cells[0]), rule, *(line(row) for row in cells[1:])])


def _rate(value: float) -> str:
    """TFLOP/s with three significant digits, so CPU rates do not print as 0.0."""
    return f"{value:.1f}" if value >= 100 else f"{value:.3g}"


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Ceilings:
    matmul_tflops: float
    matmul_method: str
    bandwidth_gbps: float
    bandwidth_method: str

    def floor_ms(self, flops: float, bytes_moved: float) -> float:
        return max(flops / (self.matmul_tflops * 1e9), bytes_moved / (self.bandwidth_gbps * 1e6))


def _matmul_tflops(timer: Timer, size: int, dtype: torch.dtype) -> float:
    a = _uniform((size, size), dtype, timer.device, seed=11)
    b = _uniform((size, size), dtype, timer.device, seed=12)
    return 2 * size**3 / (min(timer.samples_ms(lambda: torch.matmul(a, b))) * 1e9)


def _copy_gbps(timer: Timer, num_bytes: int) -> float:
    source = torch.ones(num_bytes, dtype=torch.uint8, device=timer.device)
    destination = torch.empty_like(source)
    return 2 * num_bytes / (min(timer.samples_ms(lambda: destination.copy_(source))) * 1e6)


def measure_ceilings(timer: Timer, dtype: torch.dtype) -> Ceilings:
    """The fastest of ``timer.reps`` runs of a large matmul in ``dtype`` (fp32
    on the CPU, where the library computes in fp32) and of a copy."""
    if _is_cuda(timer.device):
        size, copy_bytes, where = 8192, 1 << 30, "device to device"
    else:
        size, copy_bytes, where, dtype = 2048, 256 << 20, "in host memory", torch.float32
    return Ceilings(
        matmul_tflops=_matmul_tflops(timer, size, dtype),
        matmul_method=f"torch.matmul {dtype_name(dtype)} {size}^3",
        bandwidth_gbps=_copy_gbps(timer, copy_bytes),
        bandwidth_method=f"Tensor.copy_ {where} {copy_bytes >> 20} MiB, read + write",
    )


# ---------------------------------------------------------------------------
# Variants


@dataclass
class Prepared:
    """A variant ready to time: ``run`` is the timed call, made inside
    ``context()`` (entered once around all runs, so that its cost stays out
    of the timed calls); ``comparable`` turns its result into the suite's
    common layout for the output check."""

    run: Callable[[], torch.Tensor]
    comparable: Callable[[torch.Tensor], torch.Tensor] = lambda output: output
    context: Callable[[], AbstractContextManager] = contextlib.nullcontext


@dataclass(frozen=True)
class Variant:
    name: str
    timed: str  # what one timed run covers, and what was done beforehand
    prepare: Callable[[Any], Prepared]


def _current_stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream if _is_cuda(device) else 0


# LCE ------------------------------------------------------------------------


@dataclass(frozen=True)
class LceShape:
    B: int
    ratio: int
    M: int
    N: int
    Ku: int
    Kc: int

    @property
    def U(self) -> int:
        return users_for_ratio(self.B, self.ratio)

    def label(self) -> str:
        return f"B={self.B} ratio={self.ratio}"

    def fields(self) -> dict:
        return {
            "B": self.B,
            "ratio": self.ratio,
            "U": self.U,
            "M": self.M,
            "N": self.N,
            "Ku": self.Ku,
            "Kc": self.Kc,
        }

    def work(self, element_bytes: int) -> tuple[float, float]:
        """(FLOPs, minimum bytes) of the IKBO computation."""
        B, U, M, N, Ku, Kc = self.B, self.U, self.M, self.N, self.Ku, self.Kc
        flops = 2.0 * M * N * (B * Kc + U * Ku)
        elements = B * Kc * N + U * Ku * N + M * (Ku + Kc) + B * M * N
        return flops, float(elements * element_bytes)


@dataclass
class LceWorkload:
    """One request: ``weight`` is the model's ``[M, Ku + Kc]`` over the
    concatenated ``[user ; candidate]`` embeddings, user columns first."""

    shape: LceShape
    weight: torch.Tensor
    e_u: torch.Tensor
    e_c: torch.Tensor
    cand_to_user: torch.Tensor

    @classmethod
    def make(cls, shape: LceShape, device: torch.device, dtype: torch.dtype) -> LceWorkload:
        counts = candidate_counts(shape.B, shape.U)
        k = shape.Ku + shape.Kc
        return cls(
            shape,
            _uniform((shape.M, k), dtype, device, _SEED_WEIGHT, scale=1 / math.sqrt(k)),
            _uniform((shape.U, shape.Ku, shape.N), dtype, device, _SEED_USER),
            _uniform((shape.B, shape.Kc, shape.N), dtype, device, _SEED_CANDIDATE),
            cand_to_user_for(counts, device),
        )

    def split_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_c, w_u) as dense matrices of their own."""
        ku = self.shape.Ku
        return self.weight[:, ku:].contiguous(), self.weight[:, :ku].contiguous()


def _replicate_and_concatenate(work: LceWorkload) -> torch.Tensor:
    """``[e_u[u(b)] ; e_c[b]]`` for every candidate: the standard inference copy."""
    return torch.cat([work.e_u.index_select(0, work.cand_to_user), work.e_c], dim=1)


def _prepare_broadcast(work: LceWorkload) -> Prepared:
    stacked = _replicate_and_concatenate(work)
    return Prepared(lambda: torch.matmul(work.weight, stacked))


def _prepare_broadcast_copy(work: LceWorkload) -> Prepared:
    return Prepared(lambda: torch.matmul(work.weight, _replicate_and_concatenate(work)))


def _decomposed(
    w_c: torch.Tensor, w_u: torch.Tensor, e_c: torch.Tensor, e_u: torch.Tensor, index: torch.Tensor
) -> torch.Tensor:
    """Published stage 1: the user GEMM at U rows, the candidate GEMM at B,
    and a gather-add of the small user result (both partials rounded)."""
    out = torch.matmul(w_c, e_c)
    return out.add_(torch.matmul(w_u, e_u).index_select(0, index))


def _prepare_decomposed(work: LceWorkload) -> Prepared:
    w_c, w_u = work.split_weight()
    return Prepared(lambda: _decomposed(w_c, w_u, work.e_c, work.e_u, work.cand_to_user))


def _pad_dim(tensor: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    """``tensor`` with zeros appended along ``dim`` up to a multiple of
    ``multiple`` (a copy; ``tensor`` itself when nothing is missing). Zero
    rows meet zero columns: the products are exact."""
    missing = -tensor.shape[dim] % multiple
    if missing == 0:
        return tensor
    padding = list(tensor.shape)
    padding[dim] = missing
    return torch.cat([tensor, tensor.new_zeros(padding)], dim=dim)


def _prepare_aligned(work: LceWorkload) -> Prepared:
    # cuBLAS's fast fp16 kernels want the reduction length itself to be a
    # multiple of 8 (16-byte rows), so K is padded in the weights and in the
    # embeddings, as a model that emits K-padded embeddings would.
    w_c, w_u = (_pad_dim(matrix, 1, 8) for matrix in work.split_weight())
    e_c, e_u = _pad_dim(work.e_c, 1, 8), _pad_dim(work.e_u, 1, 8)
    return Prepared(lambda: _decomposed(w_c, w_u, e_c, e_u, work.cand_to_user))


def _lce_plan_and_map(work: LceWorkload) -> tuple[int, ikbo.LcePlan, ikbo.CandidateMap]:
    """(the current stream, an LcePlan, a CandidateMap), prepared once per shape."""
    stream = _current_stream(work.e_c.device)
    plan = ikbo.LcePlan(*work.split_weight(), stream)
    return stream, plan, ikbo.CandidateMap(work.cand_to_user, work.shape.U, stream)


def _prepare_ikbo_lce(work: LceWorkload) -> Prepared:
    _, plan, mapping = _lce_plan_and_map(work)
    return Prepared(lambda: ikbo.lce(plan, None, work.e_c, work.e_u, mapping))


def _prepare_fused(work: LceWorkload) -> Prepared:
    # Published stage 3 on the library's Hopper kernel (ikbo-bench's fused):
    # ikbo.lce's call, with the user GEMM in a launch of its own.
    stream, plan, mapping = _lce_plan_and_map(work)
    # Poisoned: the output check must not pass on an earlier variant's result.
    out = work.e_c.new_full((work.shape.B, plan.m, work.e_c.shape[2]), float("nan"))
    workspace_bytes = _C.lce_workspace_bytes(plan, work.e_c, work.e_u, mapping)
    workspace = (
        torch.empty(workspace_bytes, dtype=torch.uint8, device=work.e_c.device)
        if workspace_bytes
        else None
    )
    blocker = _C.baseline.lce_fused_blocker(plan, work.e_c, work.e_u, mapping, out, workspace)
    if blocker is not None:
        raise _Unavailable(blocker)

    def run() -> torch.Tensor:
        _C.baseline.lce_fused(plan, work.e_c, work.e_u, mapping, out, stream, workspace)
        return out

    return Prepared(run)


LCE_VARIANTS = (
    Variant(
        "broadcast",
        "one GEMM (torch.matmul) over [e_u[u(b)] ; e_c[b]], replicated and concatenated "
        "beforehand (not timed)",
        _prepare_broadcast,
    ),
    Variant(
        "broadcast+copy",
        "index_select of e_u to the candidates + torch.cat + the GEMM: what standard "
        "inference pays",
        _prepare_broadcast_copy,
    ),
    Variant(
        "decomposed",
        "user GEMM at U rows + candidate GEMM at B (torch.matmul) + gather-add "
        "(index_select + add_); weights split once",
        _prepare_decomposed,
    ),
    Variant(
        "aligned",
        "decomposed with K padded to a multiple of 8: weights padded once, e_u and e_c "
        "padded with zero rows beforehand (not timed), as a model emitting K-padded "
        "embeddings would",
        _prepare_aligned,
    ),
    Variant(
        "ikbo",
        "ikbo.lce with an LcePlan and a CandidateMap prepared beforehand",
        _prepare_ikbo_lce,
    ),
)
# CUDA only, between aligned and ikbo: where the Hopper kernel does not run
# (another GPU, a shape it does not take) it is skipped with the reason.
LCE_FUSED_VARIANT = Variant(
    "fused",
    "the candidate GEMM adding the user partial in its epilogue (ikbo's Hopper kernel, the "
    "user GEMM in a launch of its own before it); plan, map and workspace prepared beforehand",
    _prepare_fused,
)


def lce_variants(device: torch.device) -> tuple[Variant, ...]:
    if not _is_cuda(device):
        return LCE_VARIANTS
    return (*LCE_VARIANTS[:-1], LCE_FUSED_VARIANT, LCE_VARIANTS[-1])


# Attention ------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionShape:
    B: int
    ratio: int
    S: int
    H: int
    n_seed: int
    D: int

    @property
    def U(self) -> int:
        return users_for_ratio(self.B, self.ratio)

    def label(self) -> str:
        return f"B={self.B} ratio={self.ratio} S={self.S}"

    def fields(self) -> dict:
        return {
            "B": self.B,
            "ratio": self.ratio,
            "U": self.U,
            "S": self.S,
            "H": self.H,
            "n_seed": self.n_seed,
            "D": self.D,
            "jagged": False,
        }

    def work(self, element_bytes: int) -> tuple[float, float]:
        flops = 4.0 * self.B * self.H * self.n_seed * self.D * self.S
        elements = (2 * self.B * self.n_seed + 2 * self.U * self.S) * self.H * self.D
        return flops, float(elements * element_bytes)


@dataclass
class AttentionWorkload:
    """One request in ikbo's layout: q ``[B, n_seed, H, D]``, per-user K/V
    ``[U, S, H, D]``."""

    shape: AttentionShape
    counts: list[int]
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cand_to_user: torch.Tensor

    @classmethod
    def make(
        cls, shape: AttentionShape, device: torch.device, dtype: torch.dtype
    ) -> AttentionWorkload:
        counts = candidate_counts(shape.B, shape.U)
        per_user = (shape.U, shape.S, shape.H, shape.D)
        return cls(
            shape,
            counts,
            _uniform((shape.B, shape.n_seed, shape.H, shape.D), dtype, device, _SEED_CANDIDATE),
            _uniform(per_user, dtype, device, _SEED_USER),
            _uniform(per_user, dtype, device, _SEED_USER_VALUES),
            cand_to_user_for(counts, device),
        )

    def sdpa_query(self) -> torch.Tensor:
        return self.q.transpose(1, 2).contiguous()  # [B, H, n_seed, D]

    def sdpa_user_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k.transpose(1, 2).contiguous(), self.v.transpose(1, 2).contiguous()


_SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def _with_backend(
    backend: str,
    run: Callable[[], torch.Tensor],
    comparable: Callable[[torch.Tensor], torch.Tensor],
) -> Prepared:
    """``run`` (SDPA calls) restricted to one SDPA backend."""
    return Prepared(run, comparable, lambda: sdpa_kernel([_SDPA_BACKENDS[backend]]))


def _from_sdpa_layout(output: torch.Tensor) -> torch.Tensor:
    return output.transpose(1, 2)  # [B, H, n_seed, D] -> [B, n_seed, H, D]


def _prepare_sdpa(backend: str) -> Callable[[AttentionWorkload], Prepared]:
    def prepare(work: AttentionWorkload) -> Prepared:
        q = work.sdpa_query()
        k, v = (kv.index_select(0, work.cand_to_user) for kv in work.sdpa_user_kv())
        return _with_backend(
            backend, lambda: F.scaled_dot_product_attention(q, k, v), _from_sdpa_layout
        )

    return prepare


def _prepare_sdpa_copy(backend: str) -> Callable[[AttentionWorkload], Prepared]:
    def prepare(work: AttentionWorkload) -> Prepared:
        q = work.sdpa_query()
        k, v = work.sdpa_user_kv()
        index = work.cand_to_user

        def run() -> torch.Tensor:
            return F.scaled_dot_product_attention(
                q, k.index_select(0, index), v.index_select(0, index)
            )

        return _with_backend(backend, run, _from_sdpa_layout)

    return prepare


def _prepare_packed(backend: str) -> Callable[[AttentionWorkload], Prepared]:
    def prepare(work: AttentionWorkload) -> Prepared:
        # The queries of one user's candidates (contiguous: the mapping is
        # sorted) become one long query sequence, zero-padded to the largest
        # group, so one SDPA call reads each user's K/V once.
        n_seed, counts = work.shape.n_seed, work.counts
        longest = max(counts) * n_seed
        packed = work.q.new_zeros(len(counts), longest, work.shape.H, work.shape.D)
        starts = list(itertools.accumulate(counts, initial=0))
        for user, count in enumerate(counts):
            packed[user, : count * n_seed] = work.q[starts[user] : starts[user + 1]].flatten(0, 1)
        q = packed.transpose(1, 2).contiguous()  # [U, H, longest, D]
        k, v = work.sdpa_user_kv()

        def unpack(output: torch.Tensor) -> torch.Tensor:
            rows = output.transpose(1, 2)  # [U, longest, H, D]
            valid = [rows[user, : count * n_seed] for user, count in enumerate(counts)]
            return torch.cat(valid).unflatten(0, (work.shape.B, n_seed))

        return _with_backend(backend, lambda: F.scaled_dot_product_attention(q, k, v), unpack)

    return prepare


def _prepare_ikbo_attention(work: AttentionWorkload) -> Prepared:
    stream = _current_stream(work.q.device)
    mapping = ikbo.CandidateMap(work.cand_to_user, work.shape.U, stream)
    return Prepared(lambda: ikbo.attention(work.q, work.k, work.v, mapping))


def _attention_backends(device: torch.device) -> tuple[list[str], str]:
    """SDPA backends to time on pre-broadcast K/V, and the one the copy and
    packed variants use (cuDNN, the fastest on Hopper; the CPU has only flash)."""
    backends = ["flash", "cudnn"] if _is_cuda(device) else ["flash"]
    return backends, backends[-1]


def attention_variants(device: torch.device) -> tuple[Variant, ...]:
    backends, fast = _attention_backends(device)
    pre_broadcast = tuple(
        Variant(
            f"sdpa-{backend}",
            f"SDPA ({backend} backend) on K/V replicated to [B, H, S, D] beforehand (not timed)",
            _prepare_sdpa(backend),
        )
        for backend in backends
    )
    return (
        *pre_broadcast,
        Variant(
            f"sdpa-{fast}+copy",
            f"index_select of K and V to [B, H, S, D] + SDPA ({fast}): what standard "
            "inference pays",
            _prepare_sdpa_copy(fast),
        ),
        Variant(
            f"packed-{fast}",
            f"one SDPA ({fast}) over per-user query blocks [U, H, max_count*n_seed, D] "
            "(packed and zero-padded beforehand, not timed) against K/V [U, H, S, D]",
            _prepare_packed(fast),
        ),
        Variant(
            "ikbo",
            "ikbo.attention with a CandidateMap prepared beforehand; K/V [U, S, H, D] read in "
            "place",
            _prepare_ikbo_attention,
        ),
    )


# Linear ---------------------------------------------------------------------


@dataclass(frozen=True)
class LinearShape:
    B: int
    ratio: int
    N_out: int
    Ku: int
    Kc: int

    @property
    def U(self) -> int:
        return users_for_ratio(self.B, self.ratio)

    def label(self) -> str:
        return f"B={self.B} ratio={self.ratio}"

    def fields(self) -> dict:
        return {
            "B": self.B,
            "ratio": self.ratio,
            "U": self.U,
            "N_out": self.N_out,
            "Ku": self.Ku,
            "Kc": self.Kc,
        }

    def work(self, element_bytes: int) -> tuple[float, float]:
        """(FLOPs, minimum bytes) of the IKBO computation: the user rows
        multiplied once per user; every input read once (weight and bias
        included), the output written once."""
        B, U, N_out, Ku, Kc = self.B, self.U, self.N_out, self.Ku, self.Kc
        flops = 2.0 * N_out * (B * Kc + U * Ku)
        elements = B * Kc + U * Ku + N_out * (Ku + Kc) + N_out + B * N_out
        return flops, float(elements * element_bytes)


@dataclass
class LinearWorkload:
    """One request: torch's ``weight`` ``[N_out, Ku + Kc]`` and ``bias``
    ``[N_out]`` over the concatenated ``[x_u[u(b)] | x_c[b]]`` features,
    user columns first."""

    shape: LinearShape
    weight: torch.Tensor
    bias: torch.Tensor
    x_u: torch.Tensor
    x_c: torch.Tensor
    cand_to_user: torch.Tensor

    @classmethod
    def make(cls, shape: LinearShape, device: torch.device, dtype: torch.dtype) -> LinearWorkload:
        counts = candidate_counts(shape.B, shape.U)
        k = shape.Ku + shape.Kc
        scale = 1 / math.sqrt(k)  # nn.Linear's initialization range, fan-in Ku + Kc
        return cls(
            shape,
            _uniform((shape.N_out, k), dtype, device, _SEED_WEIGHT, scale=scale),
            _uniform((shape.N_out,), dtype, device, _SEED_BIAS, scale=scale),
            _uniform((shape.U, shape.Ku), dtype, device, _SEED_USER),
            _uniform((shape.B, shape.Kc), dtype, device, _SEED_CANDIDATE),
            cand_to_user_for(counts, device),
        )

    def split_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_u, w_c) as dense matrices of their own."""
        ku = self.shape.Ku
        return self.weight[:, :ku].contiguous(), self.weight[:, ku:].contiguous()


def _replicate_and_concatenate_features(work: LinearWorkload) -> torch.Tensor:
    """``[x_u[u(b)] | x_c[b]]`` for every candidate: the standard inference copy."""
    return torch.cat([work.x_u.index_select(0, work.cand_to_user), work.x_c], dim=-1)


def _prepare_linear_broadcast(work: LinearWorkload) -> Prepared:
    features = _replicate_and_concatenate_features(work)
    return Prepared(lambda: F.linear(features, work.weight, work.bias))


def _prepare_linear_broadcast_copy(work: LinearWorkload) -> Prepared:
    return Prepared(
        lambda: F.linear(_replicate_and_concatenate_features(work), work.weight, work.bias)
    )


def _prepare_linear_decomposed(work: LinearWorkload) -> Prepared:
    w_u, w_c = work.split_weight()

    def run() -> torch.Tensor:
        # The user part (bias included) at U rows, the candidate part at B,
        # and a gather-add of the small user result (both partials rounded).
        out = F.linear(work.x_c, w_c)
        return out.add_(F.linear(work.x_u, w_u, work.bias).index_select(0, work.cand_to_user))

    return Prepared(run)


def _prepare_ikbo_linear(work: LinearWorkload) -> Prepared:
    stream = _current_stream(work.x_c.device)
    plan = ikbo.LinearPlan.from_concatenated(work.weight, work.shape.Ku, work.bias, stream)
    mapping = ikbo.CandidateMap(work.cand_to_user, work.shape.U, stream)
    return Prepared(lambda: ikbo.linear(plan, work.x_c, work.x_u, mapping))


LINEAR_VARIANTS = (
    Variant(
        "broadcast",
        "F.linear over [x_u[u(b)] | x_c[b]], replicated and concatenated beforehand (not timed)",
        _prepare_linear_broadcast,
    ),
    Variant(
        "broadcast+copy",
        "index_select of x_u to the candidates + torch.cat + F.linear: what standard "
        "inference pays",
        _prepare_linear_broadcast_copy,
    ),
    Variant(
        "decomposed",
        "user part F.linear(x_u, w_u, bias) at U rows + candidate part F.linear(x_c, w_c) "
        "at B + gather-add (index_select + add_); weight split once",
        _prepare_linear_decomposed,
    ),
    Variant(
        "ikbo",
        "ikbo.linear with a LinearPlan and a CandidateMap prepared beforehand",
        _prepare_ikbo_linear,
    ),
)


# ---------------------------------------------------------------------------
# Suites


@dataclass(frozen=True)
class Suite:
    """A suite: its variants, which of them are the broadcast baselines
    (for the speedup fields) and how to make a request's workload."""

    name: str
    variants: tuple[Variant, ...]
    broadcast: str  # the op on pre-replicated user tensors
    broadcast_copy: str  # the same with the replication timed
    make_workload: Callable[[Any, torch.device, torch.dtype], Any]


def lce_suite(device: torch.device) -> Suite:
    return Suite("lce", lce_variants(device), "broadcast", "broadcast+copy", LceWorkload.make)


def linear_suite() -> Suite:
    return Suite("linear", LINEAR_VARIANTS, "broadcast", "broadcast+copy", LinearWorkload.make)


def attention_suite(device: torch.device) -> Suite:
    _, fast = _attention_backends(device)
    return Suite(
        "attention",
        attention_variants(device),
        f"sdpa-{fast}",
        f"sdpa-{fast}+copy",
        AttentionWorkload.make,
    )


def _relative_error(expected: torch.Tensor, actual: torch.Tensor) -> float:
    expected64, actual64 = expected.double(), actual.double()
    scale = torch.linalg.vector_norm(expected64)
    difference = torch.linalg.vector_norm(actual64 - expected64)
    return float(difference / scale) if scale > 0 else float(difference)


@dataclass
class SuiteResult:
    records: list[dict] = field(default_factory=list)
    not_measured: list[dict] = field(default_factory=list)


class _Mismatch(Exception):
    """A variant's output differs from the reference variant's."""


class _Unavailable(Exception):
    """A variant that cannot run here (the message says why): skipped."""


def _check_and_time(
    variant: Variant,
    workload: Any,
    reference: tuple[str, torch.Tensor] | None,
    tolerance: float,
    timer: Timer,
) -> tuple[Spread, torch.Tensor | None]:
    """(the run times of ``variant``, its output in the common layout when
    there is no ``reference`` (name, output) yet to check it against)."""
    prepared = variant.prepare(workload)
    with prepared.context():
        output = prepared.comparable(prepared.run())
        if reference is not None:
            name, expected = reference
            error = _relative_error(expected, output)
            if not error <= tolerance:
                raise _Mismatch(
                    f"output differs from {name}'s by relative error {error:.2e} > {tolerance:.0e}"
                )
            output = None
        return timer.spread_ms(prepared.run), output


def run_suite(
    suite: Suite,
    shapes: Sequence[Any],
    dtype: torch.dtype,
    timer: Timer,
    ceilings: Ceilings,
) -> SuiteResult:
    """Checks every variant of ``suite`` against its first measured variant
    and times it, at every shape."""
    result = SuiteResult()
    element_bytes = torch.empty((), dtype=dtype).element_size()
    for shape in shapes:
        workload = suite.make_workload(shape, timer.device, dtype)
        flops, bytes_moved = shape.work(element_bytes)
        floor_ms = ceilings.floor_ms(flops, bytes_moved)
        shape_fields = {"dtype": dtype_name(dtype), **shape.fields()}
        reference: tuple[str, torch.Tensor] | None = None
        measured: list[dict] = []
        for variant in suite.variants:
            head = {"suite": suite.name, "variant": variant.name}
            failure = None
            try:
                spread, output = _check_and_time(
                    variant, workload, reference, CHECK_TOLERANCE[dtype], timer
                )
            except torch.OutOfMemoryError as error:
                failure = ("skipped", f"out of memory: {str(error).splitlines()[0]}")
            except _Unavailable as error:
                failure = ("skipped", str(error))
            except _Mismatch as error:
                failure = ("failed", str(error))
            except Exception as error:  # noqa: BLE001 -- reported; the other variants go on
                failure = ("failed", f"{type(error).__name__}: {error}".splitlines()[0])
            if _is_cuda(timer.device):
                torch.cuda.empty_cache()  # the next variant's copies may need the space
            if failure is not None:
                outcome, reason = failure
                _progress(f"{suite.name} {shape.label()}: {variant.name} {outcome}: {reason}")
                result.not_measured.append(
                    {**head, **shape_fields, "outcome": outcome, "reason": reason}
                )
                continue
            if output is not None:
                reference = (variant.name, output)
            clocks = timer.last_clocks or {}
            median_ms = spread.median
            note = f"{suite.name} {shape.label()}: {variant.name} {median_ms:.3f} ms"
            if clocks:
                limits = "".join(f", {limit}" for limit in clocks["clock_limits"])
                note += (
                    f" ({clocks['sm_mhz']:.0f} MHz{limits}, after {clocks['settled_ms']} ms idle)"
                )
            _progress(note)
            measured.append(
                {
                    **head,
                    **shape_fields,
                    "median_ms": median_ms,
                    "min_ms": spread.min,
                    "max_ms": spread.max,
                    "tflops": flops / (median_ms * 1e9),
                    "gbps": bytes_moved / (median_ms * 1e6),
                    "floor_ms": floor_ms,
                    "pct_of_floor": 100 * floor_ms / median_ms,
                    **clocks,
                }
            )
        del reference, workload
        times = {record["variant"]: record["median_ms"] for record in measured}
        for record in measured:
            for key, baseline in (
                ("speedup_vs_broadcast_copy", suite.broadcast_copy),
                ("speedup_vs_broadcast", suite.broadcast),
            ):
                if baseline in times:
                    record[key] = times[baseline] / record["median_ms"]
        result.records.extend(measured)
    return result


# ---------------------------------------------------------------------------
# Shapes


@dataclass(frozen=True)
class Sweeps:
    """A suite's default shapes on one kind of device: ``B`` at the reference
    ratio and ``ratio`` at the reference B (lce, linear), or ``S`` at the reference
    B and ratio (attention); ``dims`` are the remaining shape fields."""

    reference_b: int
    reference_ratio: int
    dims: tuple[int, ...]
    b_sweep: tuple[int, ...] = ()
    ratio_sweep: tuple[int, ...] = ()
    s_sweep: tuple[int, ...] = ()


# SPEC's reference shapes and sweeps.
LCE_GPU = Sweeps(
    1024,
    70,
    dims=(433, 256, 1178, 866),
    b_sweep=(512, 1024, 1536, 2048, 2560, 3072),
    ratio_sweep=(2, 5, 10, 50, 100, 1000),
)
ATTENTION_GPU = Sweeps(2048, 64, dims=(2, 64, 128), s_sweep=(512, 1024, 2048, 4096, 8192, 16384))
# Scaled down for two CPU cores: M, N, Ku, Kc about a quarter of the
# reference, with K still no multiple of 8 (Ku = 294, Kc = 218).
LCE_CPU = Sweeps(
    512, 70, dims=(109, 64, 294, 218), b_sweep=(256, 512, 1024), ratio_sweep=(2, 10, 100)
)
ATTENTION_CPU = Sweeps(256, 64, dims=(2, 64, 128), s_sweep=(256, 512))
# The first MLP layer of examples/ranking_model/model.py, dims (N_out, Ku, Kc):
# N_out is the first MLP width, Ku the user tower's output, Kc the candidate
# side of the concatenation (candidate features + M projected compressed
# embeddings + the attention output). SPEC_CONFIG: 512, 256,
# 256 + 433*8 + 2*128 = 3976; SMALL_CONFIG on the CPU: 256, 64,
# 64 + 109*4 + 2*64 = 628.
LINEAR_GPU = Sweeps(
    1024, 70, dims=(512, 256, 3976), b_sweep=(512, 1024, 2048, 3072), ratio_sweep=(2, 10, 100, 1000)
)
LINEAR_CPU = Sweeps(
    512, 70, dims=(256, 64, 628), b_sweep=(256, 512, 1024), ratio_sweep=(2, 10, 100)
)


def _b_ratio_pairs(
    sweeps: Sweeps, b_list: Sequence[int] | None, ratio_list: Sequence[int] | None
) -> list[tuple[int, int]]:
    """The default B and ratio sweeps, or the given lists crossed."""
    if b_list is None and ratio_list is None:
        pairs = [(b, sweeps.reference_ratio) for b in sweeps.b_sweep]
        pairs += [(sweeps.reference_b, r) for r in sweeps.ratio_sweep]
    else:
        pairs = list(
            itertools.product(
                b_list or [sweeps.reference_b], ratio_list or [sweeps.reference_ratio]
            )
        )
    return list(dict.fromkeys(pairs))


def lce_shapes(
    sweeps: Sweeps, b_list: Sequence[int] | None, ratio_list: Sequence[int] | None
) -> list[LceShape]:
    return [LceShape(b, r, *sweeps.dims) for b, r in _b_ratio_pairs(sweeps, b_list, ratio_list)]


def linear_shapes(
    sweeps: Sweeps, b_list: Sequence[int] | None, ratio_list: Sequence[int] | None
) -> list[LinearShape]:
    pairs = _b_ratio_pairs(sweeps, b_list, ratio_list)
    return [LinearShape(b, r, *sweeps.dims) for b, r in pairs]


def attention_shapes(
    sweeps: Sweeps,
    b_list: Sequence[int] | None,
    ratio_list: Sequence[int] | None,
    s_list: Sequence[int] | None,
) -> list[AttentionShape]:
    grid = itertools.product(
        b_list or [sweeps.reference_b],
        ratio_list or [sweeps.reference_ratio],
        s_list or sweeps.s_sweep,
    )
    return [AttentionShape(b, r, s, *sweeps.dims) for b, r, s in dict.fromkeys(grid)]


# ---------------------------------------------------------------------------
# Tables and plots


def _by_shape(records: Sequence[dict], keys: Sequence[str]) -> dict[tuple, dict[str, dict]]:
    """Records grouped by the values of ``keys``, then by variant (in order)."""
    grouped: dict[tuple, dict[str, dict]] = {}
    for record in records:
        grouped.setdefault(tuple(record[key] for key in keys), {})[record["variant"]] = record
    return grouped


def _reference_shape(records: Sequence[dict], keys: Sequence[str], reference: tuple) -> tuple:
    shapes = list(_by_shape(records, keys))
    return reference if reference in shapes else shapes[0]


def _b_ratio_sweep_table(records: Sequence[dict], suite: Suite) -> str:
    """Median ms of every variant at every (B, ratio), with the floor and
    ikbo's speedup over the timed broadcast copy."""
    keys = ("B", "ratio", "U")
    names = [variant.name for variant in suite.variants]
    sweep_rows = []
    for shape, by_variant in _by_shape(records, keys).items():
        row = [*shape]
        row += [
            f"{by_variant[name]['median_ms']:.3f}" if name in by_variant else "-" for name in names
        ]
        any_record = next(iter(by_variant.values()))
        ikbo_record = by_variant.get("ikbo", {})
        speedup = ikbo_record.get("speedup_vs_broadcast_copy")
        row += [f"{any_record['floor_ms']:.3f}", f"{speedup:.2f}x" if speedup else "-"]
        sweep_rows.append(row)
    return format_table(
        [*keys, *(f"{name} ms" for name in names), "floor ms", "ikbo vs +copy"], sweep_rows
    )


def _reference_table(
    records: Sequence[dict], reference: tuple[int, int]
) -> tuple[tuple[int, int], str]:
    """((B, ratio), a table of every variant at that shape): ``reference``
    when it was measured, else the first shape."""
    b, ratio = _reference_shape(records, ("B", "ratio"), reference)
    rows = []
    for record in records:
        if (record["B"], record["ratio"]) != (b, ratio):
            continue
        speedup = record.get("speedup_vs_broadcast")
        rows.append(
            [
                record["variant"],
                f"{record['median_ms']:.3f}",
                f"{speedup:.2f}x" if speedup else "-",
                _rate(record["tflops"]),
                f"{record['pct_of_floor']:.0f}%",
            ]
        )
    table = format_table(["variant", "ms", "vs broadcast", "TFLOP/s", "% of floor"], rows)
    return (b, ratio), table


def _legend(suite: Suite) -> str:
    return "\n".join(f"  {variant.name}: {variant.timed}" for variant in suite.variants)


def lce_tables(records: Sequence[dict], suite: Suite, reference: tuple[int, int]) -> str:
    if not records:
        return "lce: nothing measured"
    first = records[0]
    dims = f"M={first['M']}, N={first['N']}, Ku={first['Ku']}, Kc={first['Kc']}, {first['dtype']}"
    sweep = _b_ratio_sweep_table(records, suite)
    (b, ratio), staircase = _reference_table(records, reference)
    return (
        f"LCE, {dims} (median ms)\n\n{sweep}\n\n"
        f"LCE staircase at B={b}, ratio {ratio}\n\n{staircase}\n\nWhat each variant times:\n"
        f"{_legend(suite)}"
    )


def linear_tables(records: Sequence[dict], suite: Suite, reference: tuple[int, int]) -> str:
    if not records:
        return "linear: nothing measured"
    first = records[0]
    dims = f"N_out={first['N_out']}, Ku={first['Ku']}, Kc={first['Kc']}, {first['dtype']}"
    sweep = _b_ratio_sweep_table(records, suite)
    (b, ratio), variants = _reference_table(records, reference)
    return (
        f"Linear, {dims} (median ms)\n\n{sweep}\n\n"
        f"Linear variants at B={b}, ratio {ratio} "
        f"(TFLOP/s = 2*N_out*(B*Kc + U*Ku) / median time for every variant)\n\n{variants}\n\n"
        f"What each variant times:\n{_legend(suite)}"
    )


def attention_table(records: Sequence[dict], suite: Suite) -> str:
    if not records:
        return "attention: nothing measured"
    keys = ("B", "ratio", "U", "S")
    names = [variant.name for variant in suite.variants]
    rows = []
    for shape, by_variant in _by_shape(records, keys).items():
        row = [*shape]
        row += [_rate(by_variant[name]["tflops"]) if name in by_variant else "-" for name in names]
        ikbo_record = by_variant.get("ikbo")
        row.append(f"{ikbo_record['median_ms']:.3f}" if ikbo_record else "-")
        rows.append(row)
    first = records[0]
    dims = f"H={first['H']}, n_seed={first['n_seed']}, D={first['D']}, {first['dtype']}"
    table = format_table([*keys, *(f"{name} TFLOP/s" for name in names), "ikbo ms"], rows)
    return (
        f"Attention, {dims} (TFLOP/s = 4*B*H*n_seed*D*S / median time)\n\n{table}\n\n"
        f"What each variant times:\n{_legend(suite)}"
    )


def _longest_sweep(records: Sequence[dict], fixed: Sequence[str], varying: str) -> list[dict]:
    """The records of the group (equal ``fixed`` fields) with the most
    distinct values of ``varying``."""
    groups: dict[tuple, list[dict]] = {}
    for record in records:
        groups.setdefault(tuple(record[key] for key in fixed), []).append(record)
    if not groups:
        return []
    return max(groups.values(), key=lambda group: len({record[varying] for record in group}))


def draw_plots(
    directory: str,
    lce_records: Sequence[dict],
    attention_records: Sequence[dict],
    reference: tuple,
    linear_records: Sequence[dict] = (),
    linear_reference: tuple | None = None,
) -> list[str]:
    """Draws the sweeps, the LCE staircase and the linear variants at
    ``linear_reference`` (default ``reference``) as PNGs into ``directory``;
    returns the paths written. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    written = []

    def save(figure, axes, name: str, title: str) -> None:
        axes.set_title(title)
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize="small")
        figure.tight_layout()
        path = os.path.join(directory, name)
        figure.savefig(path, dpi=120)
        plt.close(figure)
        written.append(path)

    def sweep_plot(records, varying, value, name, title, xlabel, ylabel, log_x) -> None:
        if len({record[varying] for record in records}) < 2:
            return
        figure, axes = plt.subplots(figsize=(7, 4.5))
        by_variant: dict[str, list[dict]] = {}
        for record in records:
            by_variant.setdefault(record["variant"], []).append(record)
        for variant, group in by_variant.items():
            points = sorted((record[varying], record[value]) for record in group)
            axes.plot(*zip(*points), marker="o", label=variant)
        if value == "median_ms":
            floors = sorted({(record[varying], record["floor_ms"]) for record in records})
            axes.plot(*zip(*floors), linestyle="--", color="gray", label="roofline floor")
        if log_x:
            axes.set_xscale("log", base=2 if varying == "S" else 10)
        axes.set_xlabel(xlabel)
        axes.set_ylabel(ylabel)
        save(figure, axes, name, title)

    def b_ratio_plots(records, prefix, title, shape, bar_name, bar_title) -> None:
        """Batch and ratio sweeps, and a bar per variant at ``shape``."""
        sweep_plot(
            _longest_sweep(records, ("ratio",), "B"),
            "B",
            "median_ms",
            f"{prefix}_batch_sweep.png",
            f"{title}, batch sweep",
            "candidates B",
            "ms (median)",
            log_x=False,
        )
        sweep_plot(
            _longest_sweep(records, ("B",), "ratio"),
            "ratio",
            "median_ms",
            f"{prefix}_ratio_sweep.png",
            f"{title}, ratio sweep",
            "candidates per user",
            "ms (median)",
            log_x=True,
        )
        b, ratio = _reference_shape(records, ("B", "ratio"), shape)
        bars = [r for r in records if (r["B"], r["ratio"]) == (b, ratio)]
        figure, axes = plt.subplots(figsize=(7, 4.5))
        axes.bar([r["variant"] for r in bars], [r["median_ms"] for r in bars])
        axes.axhline(bars[0]["floor_ms"], linestyle="--", color="gray", label="roofline floor")
        axes.set_ylabel("ms (median)")
        save(figure, axes, bar_name, f"{bar_title}, B={b}, ratio {ratio}")

    if lce_records:
        b_ratio_plots(lce_records, "lce", "LCE", reference, "lce_staircase.png", "LCE staircase")
    if attention_records:
        sweep_plot(
            _longest_sweep(attention_records, ("B", "ratio"), "S"),
            "S",
            "tflops",
            "attention_sweep.png",
            "Attention, sequence sweep",
            "history length S",
            "TFLOP/s",
            log_x=True,
        )
    if linear_records:
        b_ratio_plots(
            linear_records,
            "linear",
            "Linear",
            linear_reference or reference,
            "linear_variants.png",
            "Linear variants",
        )
    return written


# ---------------------------------------------------------------------------
# Command line


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _dims(count: int, names: str) -> Callable[[str], tuple[int, ...]]:
    def parse(text: str) -> tuple[int, ...]:
        values = _int_list(text)
        if len(values) != count:
            raise argparse.ArgumentTypeError(f"expected {names}, got {text!r}")
        return tuple(values)

    return parse


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ikbo.bench",
        description="Time ikbo's LCE, attention and linear against PyTorch baselines "
        "(the published IKBO tables).",
    )
    parser.add_argument(
        "suite", nargs="?", choices=("lce", "attention", "linear", "all"), default="all"
    )
    parser.add_argument(
        "--device", help="cuda, cuda:N or cpu (default: cuda when torch and ikbo both have it)"
    )
    parser.add_argument(
        "--dtype", choices=tuple(DTYPES), default=None, help="default: fp16 on a GPU, fp32 on CPU"
    )
    parser.add_argument("--B", type=_int_list, help="candidate counts (replaces the sweeps)")
    parser.add_argument("--ratio", type=_int_list, help="candidates per user (replaces the sweeps)")
    parser.add_argument("--S", type=_int_list, help="history lengths (attention)")
    parser.add_argument(
        "--lce-dims",
        type=_dims(4, "M,N,Ku,Kc"),
        metavar="M,N,Ku,Kc",
        help="LCE dims (default: SPEC's 433,256,1178,866 on a GPU, 109,64,294,218 on the CPU)",
    )
    parser.add_argument(
        "--attention-dims",
        type=_dims(3, "H,n_seed,D"),
        metavar="H,n_seed,D",
        help="attention dims (default: 2,64,128)",
    )
    parser.add_argument(
        "--linear-dims",
        type=_dims(3, "N_out,Ku,Kc"),
        metavar="N_out,Ku,Kc",
        help="linear dims (default: the example model's first MLP layer, 512,256,3976 on a GPU, "
        "256,64,628 on the CPU)",
    )
    parser.add_argument("--reps", type=int, help="timed runs per variant (default: 30 GPU, 5 CPU)")
    parser.add_argument("--warmup", type=int, help="untimed runs first (default: 5 GPU, 1 CPU)")
    parser.add_argument(
        "--settle-ms",
        type=int,
        default=2000,
        help=f"GPU: before each variant, idle {ClockMonitor.MIN_IDLE_MS} ms and then until the "
        "driver reports no power or thermal limit on the SM clock, for at most this long "
        "(default 2000; 0: never)",
    )
    parser.add_argument("--json", metavar="FILE", help="write the records to FILE")
    parser.add_argument("--plot", metavar="DIR", help="draw PNG plots into DIR (needs matplotlib)")
    return parser


def default_device() -> torch.device:
    if torch.cuda.is_available() and ikbo.built_with_cuda() and ikbo.cuda_device_count() > 0:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the bench; returns 0 when every variant was measured or skipped
    with a reason, 1 when one failed."""
    options = _parser().parse_args(argv)
    device = torch.device(options.device) if options.device else default_device()
    if _is_cuda(device):
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    gpu = _is_cuda(device)
    dtype = DTYPES[options.dtype or ("fp16" if gpu else "fp32")]
    timer = Timer(
        device,
        reps=options.reps if options.reps is not None else (30 if gpu else 5),
        warmup=options.warmup if options.warmup is not None else (5 if gpu else 1),
        settle_ms=options.settle_ms,
    )
    lce_sweeps, attention_sweeps = (LCE_GPU, ATTENTION_GPU) if gpu else (LCE_CPU, ATTENTION_CPU)
    linear_sweeps = LINEAR_GPU if gpu else LINEAR_CPU
    if options.lce_dims:
        lce_sweeps = dataclasses.replace(lce_sweeps, dims=options.lce_dims)
    if options.attention_dims:
        attention_sweeps = dataclasses.replace(attention_sweeps, dims=options.attention_dims)
    if options.linear_dims:
        linear_sweeps = dataclasses.replace(linear_sweeps, dims=options.linear_dims)

    print(f"ikbo {ikbo.__version__}, torch {torch.__version__}, commit {commit()}")
    print(f"device: {device_name(device)} ({_backend_name(device)}), dtype {dtype_name(dtype)}")
    print(f"timing: {timer.method}; median of {timer.reps} runs after {timer.warmup} warm-up")
    ceilings = measure_ceilings(timer, dtype)
    print(
        f"ceilings: {ceilings.matmul_tflops:.1f} TFLOP/s ({ceilings.matmul_method}), "
        f"{ceilings.bandwidth_gbps:.1f} GB/s ({ceilings.bandwidth_method})\n"
    )

    lce_reference = (lce_sweeps.reference_b, lce_sweeps.reference_ratio)
    linear_reference = (linear_sweeps.reference_b, linear_sweeps.reference_ratio)
    planned = []
    if options.suite in ("lce", "all"):
        planned.append(
            (
                lce_suite(device),
                lce_shapes(lce_sweeps, options.B, options.ratio),
                lambda records, suite: lce_tables(records, suite, lce_reference),
            )
        )
    if options.suite in ("attention", "all"):
        planned.append(
            (
                attention_suite(device),
                attention_shapes(attention_sweeps, options.B, options.ratio, options.S),
                attention_table,
            )
        )
    if options.suite in ("linear", "all"):
        planned.append(
            (
                linear_suite(),
                linear_shapes(linear_sweeps, options.B, options.ratio),
                lambda records, suite: linear_tables(records, suite, linear_reference),
            )
        )
    suites = [suite for suite, _, _ in planned]
    results: dict[str, SuiteResult] = {}
    for suite, shapes, table in planned:
        results[suite.name] = run_suite(suite, shapes, dtype, timer, ceilings)
        print(table(results[suite.name].records, suite) + "\n")
    records = [record for result in results.values() for record in result.records]
    not_measured = [item for result in results.values() for item in result.not_measured]
    for item in not_measured:
        print(
            f"not measured: {item['suite']} {item['variant']} B={item['B']} "
            f"ratio={item['ratio']}: {item['outcome']}: {item['reason']}"
        )

    if options.plot:
        try:
            written = draw_plots(
                options.plot,
                results.get("lce", SuiteResult()).records,
                results.get("attention", SuiteResult()).records,
                lce_reference,
                results.get("linear", SuiteResult()).records,
                linear_reference,
            )
        except ImportError as error:
            print(f"plots skipped: matplotlib is not importable ({error})")
        else:
            for path in written:
                print(f"plot: {path}")
    if options.json:
        settings = {
            "reps": timer.reps,
            "warmup": timer.warmup,
            "timing": timer.method,
            **({"clocks": timer.clock_sampling} if timer.clock_sampling else {}),
            "cand_to_user": "sorted",
            "inputs": _INPUTS,
            "torch": torch.__version__,
            "variants": {s.name: {v.name: v.timed for v in s.variants} for s in suites},
            "baselines": {
                s.name: {"broadcast": s.broadcast, "broadcast_copy": s.broadcast_copy}
                for s in suites
            },
        }
        write_json(
            options.json, device, records, settings, dataclasses.asdict(ceilings), not_measured
        )
        print(f"records: {options.json}")
    return 1 if any(item["outcome"] == "failed" for item in not_measured) else 0


if __name__ == "__main__":
    sys.exit(main())
