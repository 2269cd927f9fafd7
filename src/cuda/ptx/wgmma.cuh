// src/cuda/ptx/wgmma.cuh — warpgroup matrix multiply-accumulate (wgmma,
// sm_90a only): shared-memory operand descriptors, the m64nNk16 f16/bf16
// instructions with fp32 accumulators (N = 224 for LCE; N = 64 and 128,
// with A from shared memory or from registers, and N = 32 from shared
// memory, for attention), and their fence / commit / wait.
//
// One wgmma is issued by the 128 threads of a warpgroup and runs
// asynchronously: D (registers) += A (shared memory) @ B (shared memory).
// Issue order: wgmma_fence() once before the first wgmma that touches
// accumulators written by ordinary instructions, the wgmmas, then
// wgmma_commit_group(); wgmma_wait<N>() returns when at most N committed
// groups are still running. Until then the accumulators and the shared
// operands belong to the tensor cores: fence_operands() keeps the compiler
// from moving accumulator accesses across these points.
//
// Accumulator fragment of m64nNk16, fp32 (w = warp within the warpgroup,
// g = lane / 4, t = lane % 4); register 4j + r, j < N / 8, holds
//   r = 0: (row 16w + g,     col 8j + 2t)    r = 1: (row 16w + g,     col 8j + 2t + 1)
//   r = 2: (row 16w + g + 8, col 8j + 2t)    r = 3: (row 16w + g + 8, col 8j + 2t + 1)
//
// Operand descriptor (64 bits): start address >> 4 in bits 0-13, leading
// byte offset >> 4 in bits 16-29, stride byte offset >> 4 in bits 32-45,
// base offset 0 in bits 49-51 (every swizzle atom starts 1024-byte
// aligned), layout in bits 62-63 (1 = 128-byte swizzle). With the 128-byte
// swizzle a 16-bit operand is made of atoms of 8 rows x 128 bytes in which
// 16-byte chunk c of row r sits at chunk c ^ (r % 8): the layout TMA writes
// with CU_TENSOR_MAP_SWIZZLE_128B, so tiles go from TMA to wgmma untouched.
//   K-major operand (rows along M or N, 64 K-elements per row): the stride
//     offset is the distance between 8-row groups; the leading offset is
//     unused; the k16 slices of a row start 32 bytes apart.
//   MN-major operand (rows along K, 64 M- or N-elements per row; wgmma's
//     "transposed" mode, 16-bit types only): the stride offset is the
//     distance between 8-row groups along K, the leading offset the distance
//     between 64-element groups along M or N; k16 slices start 2048 bytes
//     apart (two atoms).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "cuda/ptx/sm80.cuh"

namespace ikbo::detail::cuda::ptx {

// Descriptor of a 128-byte-swizzled operand starting at `tile` (shared memory).
__device__ __forceinline__ std::uint64_t wgmma_descriptor_sw128(const void* tile,
                                                                std::uint32_t leading_bytes,
                                                                std::uint32_t stride_bytes) {
  constexpr std::uint64_t kSwizzle128B = 1;
  const std::uint32_t address = shared_address(tile);
  return static_cast<std::uint64_t>((address & 0x3FFFF) >> 4) |
         static_cast<std::uint64_t>((leading_bytes >> 4) & 0x3FFF) << 16 |
         static_cast<std::uint64_t>((stride_bytes >> 4) & 0x3FFF) << 32 | kSwizzle128B << 62;
}

// The same operand `bytes` further on (bytes a multiple of 16; the start
// address field cannot carry out, since shared memory ends below 256 KiB).
__device__ __forceinline__ std::uint64_t advance_descriptor(std::uint64_t descriptor,
                                                            std::uint32_t bytes) {
  return descriptor + (bytes >> 4);
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit_group() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Pins accumulator registers in place across asynchronous wgmma work.
template <int kCount>
__device__ __forceinline__ void fence_operands(float (&values)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(values[i])::"memory");
}

// The same for A operands held in registers (RS form below).
template <int kCount>
__device__ __forceinline__ void fence_operands(std::uint32_t (&values)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+r"(values[i])::"memory");
}

// Asm operand lists of 8, 16, 32 and 64 fp32 accumulators d[i], d[i + 1], ...
#define IKBO_WGMMA_ACCUMULATORS_8(d, i)                                                  \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define IKBO_WGMMA_ACCUMULATORS_16(d, i) \
  IKBO_WGMMA_ACCUMULATORS_8(d, i), IKBO_WGMMA_ACCUMULATORS_8(d, i + 8)
#define IKBO_WGMMA_ACCUMULATORS_32(d, i) \
  IKBO_WGMMA_ACCUMULATORS_16(d, i), IKBO_WGMMA_ACCUMULATORS_16(d, i + 16)
#define IKBO_WGMMA_ACCUMULATORS_64(d, i) \
  IKBO_WGMMA_ACCUMULATORS_32(d, i), IKBO_WGMMA_ACCUMULATORS_32(d, i + 32)

// The asm operand names %0 .. %15 / %31 / %63 of the accumulators.
#define IKBO_WGMMA_REGS_16 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define IKBO_WGMMA_REGS_32 \
  IKBO_WGMMA_REGS_16 ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, " \
                     "%29, %30, %31"
#define IKBO_WGMMA_REGS_64                                                          \
  IKBO_WGMMA_REGS_32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, " \
                     "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "  \
                     "%56, %57, %58, %59, %60, %61, %62, %63"

#define IKBO_WGMMA_M64N224K16(TYPE)                                                             \
  asm volatile(                                                                                 \
      "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %114, 0;\n"                           \
      "wgmma.mma_async.sync.aligned.m64n224k16.f32." TYPE "." TYPE "\n{"                        \
      IKBO_WGMMA_REGS_64 ", "                                                                  \
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "        \
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "        \
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, " \
      "%111},\n%112, %113, accumulate, 1, 1, %115, %116;\n}\n"                                  \
      : IKBO_WGMMA_ACCUMULATORS_64(d, 0), IKBO_WGMMA_ACCUMULATORS_32(d, 64),                    \
        IKBO_WGMMA_ACCUMULATORS_8(d, 96), IKBO_WGMMA_ACCUMULATORS_8(d, 104)                     \
      : "l"(a), "l"(b), "r"(accumulate), "n"(kTransposeA), "n"(kTransposeB))

// d (64 x 224, fp32) = a (64 x 16) @ b (16 x 224) + (accumulate ? d : 0),
// both operands in shared memory. kTransposeA / kTransposeB: 0 for a
// K-major operand, 1 for an MN-major one.
template <typename Element, int kTransposeA, int kTransposeB>
__device__ __forceinline__ void wgmma_m64n224k16(float (&d)[112], std::uint64_t a, std::uint64_t b,
                                                 bool accumulate_into_d) {
  const std::uint32_t accumulate = accumulate_into_d ? 1 : 0;
  if constexpr (std::is_same_v<Element, __half>) {
    IKBO_WGMMA_M64N224K16("f16");
  } else {
    static_assert(std::is_same_v<Element, __nv_bfloat16>, "wgmma here takes f16 or bf16");
    IKBO_WGMMA_M64N224K16("bf16");
  }
}

#undef IKBO_WGMMA_M64N224K16

// ---- m64n128k16 / m64n64k16, operands from shared memory (SS) or with A
// from registers (RS), and m64n32k16 (SS): the shapes of the attention
// kernel ----
//
// RS form: A is four b32 registers per thread, each holding two f16/bf16
// elements of the 64 x 16 A tile; within its warp's 16 rows (w = warp of
// the warpgroup, g = lane / 4, t = lane % 4):
//   a[0]: (row 16w + g, cols 2t, 2t+1)       a[1]: (row 16w + g + 8, cols 2t, 2t+1)
//   a[2]: (row 16w + g, cols 2t+8, 2t+9)     a[3]: (row 16w + g + 8, cols 2t+8, 2t+9)
// That is the accumulator fragment above of two adjacent 8-column groups
// (registers 8k .. 8k+7 of an fp32 m64nN result are k16 slice k of A once
// packed in pairs), so a result can feed the next product without leaving
// registers. The A registers are read asynchronously: they must keep their
// values until the wgmma has retired (wgmma_wait), which fence_operands on
// them after the wait guarantees. There is no transpose flag for A.

// One m64nNk16 wgmma of N / 2 accumulators (REGS, ACCUMULATORS: the lists
// above). Inline asm numbers its operands by position (nvcc takes no
// symbolic names), so each shape passes the numbers of the operands after
// the accumulators: the descriptors or A registers and B, the accumulate
// flag, and the transpose immediates.
#define IKBO_WGMMA_SS(TYPE, N, REGS, ACCUMULATORS, A, B, ACCUMULATE, TRANSPOSE_A, TRANSPOSE_B) \
  asm volatile("{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, " ACCUMULATE ", 0;\n"       \
               "wgmma.mma_async.sync.aligned.m64n" N "k16.f32." TYPE "." TYPE "\n{" REGS      \
               "},\n" A ", " B ", accumulate, 1, 1, " TRANSPOSE_A ", " TRANSPOSE_B ";\n}\n"  \
               : ACCUMULATORS(d, 0)                                                          \
               : "l"(a), "l"(b), "r"(accumulate), "n"(kTransposeA), "n"(kTransposeB))

#define IKBO_WGMMA_RS(TYPE, N, REGS, ACCUMULATORS, A, B, ACCUMULATE, TRANSPOSE_B)           \
  asm volatile("{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, " ACCUMULATE ", 0;\n"    \
               "wgmma.mma_async.sync.aligned.m64n" N "k16.f32." TYPE "." TYPE "\n{" REGS   \
               "},\n{" A "}, " B ", accumulate, 1, 1, " TRANSPOSE_B ";\n}\n"              \
               : ACCUMULATORS(d, 0)                                                       \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate),     \
                 "n"(kTransposeB))

#define IKBO_WGMMA_SS_N128(TYPE)                                                          \
  IKBO_WGMMA_SS(TYPE, "128", IKBO_WGMMA_REGS_64, IKBO_WGMMA_ACCUMULATORS_64, "%64", "%65", \
                "%66", "%67", "%68")
#define IKBO_WGMMA_SS_N64(TYPE)                                                           \
  IKBO_WGMMA_SS(TYPE, "64", IKBO_WGMMA_REGS_32, IKBO_WGMMA_ACCUMULATORS_32, "%32", "%33",  \
                "%34", "%35", "%36")
#define IKBO_WGMMA_SS_N32(TYPE)                                                           \
  IKBO_WGMMA_SS(TYPE, "32", IKBO_WGMMA_REGS_16, IKBO_WGMMA_ACCUMULATORS_16, "%16", "%17",  \
                "%18", "%19", "%20")
#define IKBO_WGMMA_RS_N128(TYPE)                                                          \
  IKBO_WGMMA_RS(TYPE, "128", IKBO_WGMMA_REGS_64, IKBO_WGMMA_ACCUMULATORS_64,              \
                "%64, %65, %66, %67", "%68", "%69", "%70")
#define IKBO_WGMMA_RS_N64(TYPE)                                                           \
  IKBO_WGMMA_RS(TYPE, "64", IKBO_WGMMA_REGS_32, IKBO_WGMMA_ACCUMULATORS_32,               \
                "%32, %33, %34, %35", "%36", "%37", "%38")

// The instruction for Element: PTX takes the type as a literal.
#define IKBO_WGMMA_TYPED(INSTRUCTION)               \
  if constexpr (std::is_same_v<Element, __half>) {  \
    INSTRUCTION("f16");                             \
  } else {                                          \
    INSTRUCTION("bf16");                            \
  }

// d (64 x kN, fp32) = a (64 x 16) @ b (16 x kN) + (accumulate ? d : 0) for
// kN in {32, 64, 128}, both operands in shared memory. kTransposeA /
// kTransposeB: 0 for a K-major operand, 1 for an MN-major one.
template <typename Element, int kTransposeA, int kTransposeB, int kN>
__device__ __forceinline__ void wgmma_ss(float (&d)[kN / 2], std::uint64_t a, std::uint64_t b,
                                         bool accumulate_into_d) {
  static_assert(kN == 32 || kN == 64 || kN == 128,
                "wgmma_ss is instantiated for N = 32, 64 and 128");
  static_assert(std::is_same_v<Element, __half> || std::is_same_v<Element, __nv_bfloat16>,
                "wgmma here takes f16 or bf16");
  const std::uint32_t accumulate = accumulate_into_d ? 1 : 0;
  if constexpr (kN == 128) {
    IKBO_WGMMA_TYPED(IKBO_WGMMA_SS_N128);
  } else if constexpr (kN == 64) {
    IKBO_WGMMA_TYPED(IKBO_WGMMA_SS_N64);
  } else {
    IKBO_WGMMA_TYPED(IKBO_WGMMA_SS_N32);
  }
}

// d (64 x kN, fp32) = a (64 x 16, registers, see above) @ b (16 x kN,
// shared memory) + (accumulate ? d : 0) for kN in {64, 128}. kTransposeB:
// 0 for a K-major B, 1 for an MN-major one.
template <typename Element, int kTransposeB, int kN>
__device__ __forceinline__ void wgmma_rs(float (&d)[kN / 2], const std::uint32_t (&a)[4],
                                         std::uint64_t b, bool accumulate_into_d) {
  static_assert(kN == 64 || kN == 128, "wgmma_rs is instantiated for N = 64 and N = 128");
  static_assert(std::is_same_v<Element, __half> || std::is_same_v<Element, __nv_bfloat16>,
                "wgmma here takes f16 or bf16");
  const std::uint32_t accumulate = accumulate_into_d ? 1 : 0;
  if constexpr (kN == 128) {
    IKBO_WGMMA_TYPED(IKBO_WGMMA_RS_N128);
  } else {
    IKBO_WGMMA_TYPED(IKBO_WGMMA_RS_N64);
  }
}

#undef IKBO_WGMMA_TYPED
#undef IKBO_WGMMA_RS_N64
#undef IKBO_WGMMA_RS_N128
#undef IKBO_WGMMA_SS_N64
#undef IKBO_WGMMA_SS_N32
#undef IKBO_WGMMA_SS_N128
#undef IKBO_WGMMA_RS
#undef IKBO_WGMMA_SS
#undef IKBO_WGMMA_REGS_64
#undef IKBO_WGMMA_REGS_32
#undef IKBO_WGMMA_REGS_16
#undef IKBO_WGMMA_ACCUMULATORS_64
#undef IKBO_WGMMA_ACCUMULATORS_32
#undef IKBO_WGMMA_ACCUMULATORS_16
#undef IKBO_WGMMA_ACCUMULATORS_8

}  // namespace ikbo::detail::cuda::ptx
