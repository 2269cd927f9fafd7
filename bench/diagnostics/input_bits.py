"""Whether the inputs' mantissa bits change the GPU's speed: the Python bench's
matmul ceiling and attention at S = 512 / 1024 (SPEC shape: B = 2048, 64
candidates per user, H = 2, n_seed = 64, D = 128; ikbo and packed-cudnn),
timed on fp16 inputs drawn two ways, in interleaved rounds:

- ``fp16 draw``: ``torch.rand`` in float16 mapped to [-1, 1) in float16, as
  the Python bench drew until session 49: multiples of 2^-11, ~3,000 values
  on CUDA, whose mantissas end in 2.6 zero bits on average;
- ``fp32 draw``: drawn in float32 and rounded once, every mantissa bit
  varying, as ikbo-bench's inputs and the Python bench's since session 49.

Every check until session 49 read the Python bench's torch.matmul ceiling
1.0-1.7% above ikbo-bench's cuBLAS one (the same 8192^3 fp16 GEMM), and its
attention at S = 512 1-2% above the C++ bench's, with the same kernel. If
the draw is the cause, the rows differ here by as much.

    PYTHONPATH=<dir with the ikbo package> python3 bench/diagnostics/input_bits.py

A diagnostic, not a benchmark record: the timing is the Python bench's
(``ikbo.bench.Timer``: median of 30 runs after 5 warm-up, L2 flushed before
every run, CUDA events, the runs queued behind a GPU wait).
"""

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import ikbo
from ikbo.bench import Timer, _uniform

ROUNDS = 3
B, U, H, N_SEED, D = 2048, 32, 2, 64, 128
GEMM = 8192


def draw(how: str, shape: tuple[int, ...], seed: int, device: torch.device) -> torch.Tensor:
    if how == "fp32 draw":  # the Python bench's own draw
        return _uniform(shape, torch.float16, device, seed)
    generator = torch.Generator(device=device).manual_seed(seed)
    values = torch.rand(shape, dtype=torch.float16, device=device, generator=generator)
    return values.mul_(2).sub_(1)


def cases(how: str, device: torch.device) -> dict:
    """Name -> (FLOPs, the call)."""
    a, b = draw(how, (GEMM, GEMM), 11, device), draw(how, (GEMM, GEMM), 12, device)
    timed = {"torch.matmul 8192^3": (2 * GEMM**3, lambda: torch.matmul(a, b))}
    cand_to_user = torch.arange(U, dtype=torch.int32, device=device).repeat_interleave(B // U)
    mapping = ikbo.CandidateMap(cand_to_user, U, torch.cuda.current_stream(device).cuda_stream)
    for seq_len in (512, 1024):
        q = draw(how, (B, N_SEED, H, D), 1, device)
        k, v = (draw(how, (U, seq_len, H, D), seed, device) for seed in (2, 3))
        # packed-cudnn: each user's candidates' query rows as one sequence.
        packed_q = q.reshape(U, B // U * N_SEED, H, D).transpose(1, 2).contiguous()
        packed_k, packed_v = (t.transpose(1, 2).contiguous() for t in (k, v))

        def packed(q=packed_q, k=packed_k, v=packed_v) -> torch.Tensor:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v)

        flops = 4 * B * H * N_SEED * D * seq_len
        timed[f"ikbo attention S={seq_len}"] = (
            flops,
            lambda q=q, k=k, v=v: ikbo.attention(q, k, v, mapping),
        )
        timed[f"packed-cudnn S={seq_len}"] = (flops, packed)
    return timed


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("input_bits.py times GPU kernels: torch sees no CUDA device")
    device = torch.device("cuda")
    timer = Timer(device, reps=30, warmup=5)
    print(f"{torch.cuda.get_device_name(device)}; {timer.method}")
    draws = ("fp16 draw", "fp32 draw")
    for round_ in range(ROUNDS):
        for how in draws if round_ % 2 == 0 else reversed(draws):
            for name, (flops, call) in cases(how, device).items():
                samples = sorted(timer.samples_ms(call))
                median = samples[len(samples) // 2]
                clocks = timer.last_clocks
                sm = "SM clock not sampled"
                if clocks is not None:
                    limits = ", ".join(clocks["clock_limits"]) or "no limit"
                    sm = f"SM {clocks['sm_mhz']:.0f} MHz, {limits}"
                print(
                    f"round {round_} {how}: {name}: {flops / median / 1e9:.1f} TFLOP/s "
                    f"(median {median * 1e3:.1f} us, min {samples[0] * 1e3:.1f}; {sm})",
                    flush=True,
                )
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
