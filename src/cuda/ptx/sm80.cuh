// src/cuda/ptx/sm80.cuh — thin wrappers over the sm_80+ warp-level
// instructions the portable kernels use: cp.async (global -> shared without
// registers), ldmatrix (shared -> mma fragments), mma.sync m16n8k16 with fp32
// accumulation, and ex2.approx.
//
// mma.sync m16n8k16 fragment layout (g = lane / 4, t = lane % 4):
//   A 16x16 row-major, 4 x b32: {row g, cols 2t..2t+1}, {row g+8, cols 2t..},
//                               {row g, cols 2t+8..},   {row g+8, cols 2t+8..}
//   B 16x8 "col", 2 x b32:      {rows 2t..2t+1, col g}, {rows 2t+8.., col g}
//   C 16x8 fp32, 4 x f32:       {row g, cols 2t, 2t+1}, {row g+8, cols 2t, 2t+1}
// ldmatrix.x4 loads four 8x8 b16 matrices; lanes 8i..8i+7 give the row
// addresses of matrix i, and lane l receives row l/4, elements 2(l%4)..+1
// of each (with .trans: column l/4, i.e. of the transposed matrix).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace ikbo::detail::cuda::ptx {

__device__ __forceinline__ std::uint32_t shared_address(const void* pointer) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(pointer));
}

// 16-byte async copy; with `fill` false the destination is zero-filled and
// nothing is read (the source must still be a mapped address).
__device__ __forceinline__ void cp_async_16(std::uint32_t shared, const void* global, bool fill) {
  const int source_bytes = fill ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared), "l"(global),
               "r"(source_bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most `kPending` committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&fragment)[4], std::uint32_t shared) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(fragment[0]), "=r"(fragment[1]), "=r"(fragment[2]), "=r"(fragment[3])
               : "r"(shared));
}

__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&fragment)[4],
                                                  std::uint32_t shared) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(fragment[0]), "=r"(fragment[1]), "=r"(fragment[2]), "=r"(fragment[3])
               : "r"(shared));
}

// acc += a @ b for a 16x16 f16/bf16 A fragment and a 16x8 B fragment.
template <typename Element>
__device__ __forceinline__ void mma_m16n8k16(float (&acc)[4], const std::uint32_t (&a)[4],
                                             std::uint32_t b0, std::uint32_t b1) {
  if constexpr (std::is_same_v<Element, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    static_assert(std::is_same_v<Element, __nv_bfloat16>, "mma.sync takes f16 or bf16");
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats rounded to the element type and packed into one b32 register,
// `low` in the lower half (the lower column of an mma fragment pair).
template <typename Element>
__device__ __forceinline__ std::uint32_t pack_pair(float low, float high) {
  if constexpr (std::is_same_v<Element, __half>) {
    const __half2 pair = __floats2half2_rn(low, high);
    return *reinterpret_cast<const std::uint32_t*>(&pair);
  } else {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
    return *reinterpret_cast<const std::uint32_t*>(&pair);
  }
}

// 2^x with the hardware approximation (relative error ~2^-22); ex2(-inf) = 0,
// which the online softmax relies on for its first tile.
__device__ __forceinline__ float exp2_approx(float x) {
  float result;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(result) : "f"(x));
  return result;
}

}  // namespace ikbo::detail::cuda::ptx
