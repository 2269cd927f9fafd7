"""Host time of building a CUDA CandidateMap per request, and of the CUDA
runtime calls a build makes (a diagnostic behind bench/results/
2026-11-29-h200-s45.md; not a benchmark: no L2 flush, host clocks).

    PYTHONPATH=<dir with the ikbo package> python3 bench/diagnostics/map_build_time.py

Each case: a fresh sorted mapping (B = 1024 candidates, V = 60 vendors,
U = 15 users) per run, the device synchronized before and after, the median
of 300 runs. The CUDA runtime's own calls are timed through ctypes on the
libcudart torch ships, and the torch layer's Python through cProfile.
"""

import cProfile
import ctypes
import glob
import os
import pstats
import sys
import time

import torch

from ikbo import _C
from ikbo import torch_ops as ops

B, V, U = 1024, 60, 15
RUNS = 300
MAP_BYTES = _C.CandidateMap.device_bytes(B, U)


def request() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cand_to_user, cand_to_vendor, vendor_to_user), int32 on the GPU."""
    cand_to_vendor = torch.sort(torch.randint(0, V, (B,), device="cuda")).values.int()
    vendor_to_user = torch.sort(torch.randint(0, U, (V,), device="cuda")).values.int()
    return vendor_to_user[cand_to_vendor].contiguous(), cand_to_vendor, vendor_to_user


def median_us(samples: list[float]) -> str:
    samples.sort()
    return f"median {samples[len(samples) // 2] * 1e6:.1f} us, p10 {samples[len(samples) // 10] * 1e6:.1f}"


def time_case(name: str, case) -> None:
    samples = []
    for _ in range(RUNS):
        tensors = request()
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = case(tensors)
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
        del result, tensors
    print(f"{name}: {median_us(samples)}")


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("map_build_time: needs a CUDA device (torch.cuda.is_available() is False)")
    stream = torch.cuda.current_stream().cuda_stream
    host_map = torch.sort(torch.randint(0, U, (B,))).values.int()
    cases = {
        "torch op map, one level": lambda r: ops.candidate_map(r[0], U),
        "torch op map, two levels": lambda r: ops.candidate_map(r[1], U, [r[2]]),
        "_C map, one level": lambda r: _C.CandidateMap(r[0], U, stream),
        "_C map, one level, into storage from torch.empty": lambda r: _C.CandidateMap(
            r[0], U, stream, storage=torch.empty(MAP_BYTES, dtype=torch.uint8, device="cuda")
        ),
        "_C map, two levels from the level tensors": lambda r: _C.CandidateMap(
            r[1], U, stream, [r[2]]
        ),
        "_C map, two levels by build + build + compose": lambda r: _C.CandidateMap.compose(
            _C.CandidateMap(r[1], V, stream), _C.CandidateMap(r[2], U, stream), stream
        ),
        "_C map of a CPU tensor (no device work)": lambda r: _C.CandidateMap(host_map, U),
        "D2H .cpu() of B int32": lambda r: r[0].cpu(),
        "torch.cuda.synchronize()": lambda r: torch.cuda.synchronize(),
    }
    for name, case in cases.items():
        time_case(name, case)

    samples = []
    for _ in range(RUNS):
        built = _C.CandidateMap(request()[0], U, stream)
        torch.cuda.synchronize()
        start = time.perf_counter()
        del built  # frees its device copy
        samples.append(time.perf_counter() - start)
    print(f"dropping a CUDA map: {median_us(samples)}")
    samples = []
    for _ in range(RUNS):
        storage = torch.empty(MAP_BYTES, dtype=torch.uint8, device="cuda")
        built = _C.CandidateMap(request()[0], U, stream, storage=storage)
        del storage
        torch.cuda.synchronize()
        start = time.perf_counter()
        del built  # returns its storage to torch's caching allocator
        samples.append(time.perf_counter() - start)
    print(f"dropping a CUDA map in storage from torch.empty: {median_us(samples)}")

    pattern = os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "**", "libcudart.so*")
    libraries = glob.glob(pattern, recursive=True)
    if libraries:
        runtime = ctypes.CDLL(libraries[0])
        pointer, host = ctypes.c_void_p(), (ctypes.c_int32 * 2100)()
        cuda_stream = ctypes.c_void_p(stream)
        nbytes = 2 * B * 4 + (U + 1) * 4 + 4096  # about a map's device copy
        allocate, free = [], []
        copy = []
        for _ in range(RUNS):
            start = time.perf_counter()
            runtime.cudaMalloc(ctypes.byref(pointer), nbytes)
            allocate.append(time.perf_counter() - start)
            start = time.perf_counter()
            runtime.cudaMemcpyAsync(pointer, host, ctypes.sizeof(host), 1, cuda_stream)
            runtime.cudaStreamSynchronize(cuda_stream)
            copy.append(time.perf_counter() - start)
            start = time.perf_counter()
            runtime.cudaFree(pointer)
            free.append(time.perf_counter() - start)
        print(f"cudaMalloc of {nbytes} bytes: {median_us(allocate)}")
        print(f"H2D copy of {ctypes.sizeof(host)} pageable bytes + sync: {median_us(copy)}")
        print(f"cudaFree: {median_us(free)}")
    else:
        print(f"no libcudart under {pattern}: the runtime calls are not timed")

    tensors = [request()[0] for _ in range(200)]
    torch.cuda.synchronize()
    profile = cProfile.Profile()
    profile.enable()
    for cand_to_user in tensors:
        ops.candidate_map(cand_to_user, U)
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
