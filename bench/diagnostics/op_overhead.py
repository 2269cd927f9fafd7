"""Host time per op call at tiny shapes, where the work itself is negligible:
what each layer (the bindings, ``ikbo.lce`` & co., the torch ops) adds, and
what its pieces cost. A diagnostic (host clocks, no L2 flush), not a
benchmark.

    PYTHONPATH=<dir with the ikbo package> python3 bench/diagnostics/op_overhead.py

Runs on the CPU, and on the GPU when torch sees one. Each case: 2000 calls in
a row (on the GPU, then one synchronize), timed 7 times; the least per-call
time is printed. On the GPU, each case's time is also split in two, from a
burst of 100 calls enqueued while the GPU is held in a wait: the host's time
to enqueue a call, and the GPU's time per call once it runs the burst back to
back (CUDA events; the least of 7 bursts each). The larger of the two sets
the pace. The torch ops are timed again under ``torch.no_grad()`` and
``torch.inference_mode()``, as serving code calls them.
"""

import time

import torch

import ikbo
from ikbo import _C
from ikbo import torch_ops as ops

CALLS, REPEATS, BURST = 2000, 7, 100
# Holds the GPU while a burst is enqueued: ~10 ms at 2 GHz, several times
# what 100 calls take the host.
HOLD_CYCLES = 20_000_000


def per_call_us(case, device: torch.device) -> float:
    for _ in range(200):
        case()
    best = float("inf")
    for _ in range(REPEATS):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(CALLS):
            case()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - start) / CALLS)
    return best * 1e6


def host_and_gpu_us(case) -> tuple[float, float]:
    host = gpu = float("inf")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        torch.cuda._sleep(HOLD_CYCLES)
        start.record()
        begin = time.perf_counter()
        for _ in range(BURST):
            case()
        host = min(host, (time.perf_counter() - begin) / BURST * 1e6)
        end.record()
        end.synchronize()
        gpu = min(gpu, start.elapsed_time(end) / BURST * 1e3)
    return host, gpu


def cases(device: torch.device) -> dict:
    generator = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(shape, generator=generator).half().to(device)

    m, kc, ku, n, b, u = 16, 16, 16, 8, 8, 2
    w_c, w_u, e_c, e_u = randn(m, kc), randn(m, ku), randn(b, kc, n), randn(u, ku, n)
    weight, x_c, x_u = randn(m, ku + kc), randn(b, kc), randn(u, ku)
    q, k, v = randn(b, 4, 1, 64), randn(u, 16, 1, 64), randn(u, 16, 1, 64)
    cand_to_user = torch.tensor([0, 0, 1, 1, 0, 1, 1, 0], dtype=torch.int32, device=device)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    plan = _C.LcePlan(w_c, w_u, stream)
    mapping = _C.CandidateMap(cand_to_user, u, stream)
    out = torch.empty(b, m, n, dtype=torch.float16, device=device)
    capsule = torch.utils.dlpack.to_dlpack
    # On the GPU the op takes a workspace (its cuBLAS path's scratch among it).
    workspace_bytes = _C.lce_workspace_bytes(plan, e_c, e_u, mapping)
    workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
    return {
        "_C.lce, tensors as DLPack capsules": lambda: _C.lce(
            plan, capsule(e_c), capsule(e_u), mapping, capsule(out), stream, capsule(workspace)
        ),
        "_C.lce, torch tensors (Tensor.__dlpack__)": lambda: _C.lce(
            plan, e_c, e_u, mapping, out, stream, workspace
        ),
        "ikbo.lce(plan, map)": lambda: ikbo.lce(plan, None, e_c, e_u, mapping),
        "torch.ops.ikbo.lce": lambda: torch.ops.ikbo.lce(w_c, w_u, e_c, e_u, cand_to_user),
        "torch.ops.ikbo.linear": lambda: torch.ops.ikbo.linear(
            weight[:, ku:], weight[:, :ku], x_c, x_u, cand_to_user
        ),
        "torch.ops.ikbo.attention": lambda: torch.ops.ikbo.attention(q, k, v, cand_to_user),
        "torch_ops.candidate_map, cached": lambda: ops.candidate_map(cand_to_user, u),
        "torch.empty of the lce output": lambda: torch.empty(
            b, m, n, dtype=torch.float16, device=device
        ),
        "torch.cuda.current_stream(device).cuda_stream": (
            (lambda: torch.cuda.current_stream(device).cuda_stream)
            if device.type == "cuda"
            else None
        ),
        "torch._C._cuda_getCurrentRawStream(index)": (
            (lambda: torch._C._cuda_getCurrentRawStream(device.index or 0))
            if device.type == "cuda"
            else None
        ),
        "Tensor.__dlpack__()": lambda: e_c.__dlpack__(),
        "torch.utils.dlpack.to_dlpack": lambda: capsule(e_c),
        "torch.mm of the weights (a torch op, for scale)": lambda: torch.mm(w_c, w_u.T),
    }


def main() -> None:
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    for device in devices:
        print(f"--- {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'host'})")
        timed = cases(device)
        for name, case in timed.items():
            if case is not None:
                report(name, case, device)
        # Serving code runs under no_grad or inference_mode. Inference mode
        # skips the ops' Autograd kernel; no_grad does not.
        for mode in (torch.no_grad, torch.inference_mode):
            with mode():
                for name in ("torch.ops.ikbo.lce", "torch.ops.ikbo.attention"):
                    report(f"{name} under torch.{mode.__name__}()", timed[name], device)


def report(name: str, case, device: torch.device) -> None:
    line = f"{name}: {per_call_us(case, device):.2f} us"
    if device.type == "cuda":
        host, gpu = host_and_gpu_us(case)
        line += f" (host enqueue {host:.2f} us, GPU {gpu:.2f} us)"
    print(line)


if __name__ == "__main__":
    main()
