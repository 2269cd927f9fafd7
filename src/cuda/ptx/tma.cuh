// src/cuda/ptx/tma.cuh — the tensor memory accelerator (TMA, sm_90): bulk
// tensor copies between global and shared memory described by a tensor map.
//
// Host side: make_tensor_map() encodes a tiled tensor map over a dense
// tensor through cuTensorMapEncodeTiled, resolved with
// cudaGetDriverEntryPointByVersion so that the library never links libcuda
// and still loads on machines without a GPU driver. Encoding is pure host
// work (no allocation, no synchronization), so it may run inside CUDA graph
// capture; the map travels to the kernel by value as a
// `const __grid_constant__` parameter.
//
// Device side (wrappers over CCCL's cuda::ptx): loads that complete on an
// mbarrier (the transaction bytes of a box are always the full box: parts
// outside the tensor are filled with zeros and still counted), multicast
// loads into every CTA of a cluster, stores from
// shared memory tracked by per-thread bulk groups, and the proxy fence that
// orders ordinary shared-memory writes before the copy engine reads them.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/ptx>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "cuda/check.cuh"
#include "ikbo/error.hpp"

namespace ikbo::detail::cuda::ptx {

// ---- host ----

// A dense tensor seen by TMA, innermost dimension first. Dimension 0 is
// contiguous; strides (in bytes) are given for dimensions 1.. and must be
// multiples of 16. `box` is the tile one copy moves.
struct TensorMapLayout {
  std::uint32_t rank = 0;
  cuuint64_t dims[5] = {};
  cuuint64_t strides_bytes[4] = {};
  cuuint32_t box[5] = {};
};

namespace driver_api {

template <typename Function>
Function driver_function(const char* name, unsigned int cuda_version) {
  void* function = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  check_cuda(cudaGetDriverEntryPointByVersion(name, &function, cuda_version, cudaEnableDefault,
                                              &found),
             "cudaGetDriverEntryPointByVersion");
  if (found != cudaDriverEntryPointSuccess || function == nullptr) {
    throw RuntimeError(std::string("cudaGetDriverEntryPointByVersion(\"") + name +
                       "\") found no such driver function (a driver older than CUDA " +
                       std::to_string(cuda_version / 1000) + ".0?)");
  }
  return reinterpret_cast<Function>(function);
}

inline std::string driver_error_name(CUresult status) {
  const char* name = nullptr;
  static const auto get_error_name =
      driver_function<PFN_cuGetErrorName_v6000>("cuGetErrorName", 6000);
  if (get_error_name(status, &name) != CUDA_SUCCESS || name == nullptr) return "unknown CUresult";
  return name;
}

}  // namespace driver_api

// The tensor-map element type of a 16-bit floating Element.
template <typename Element>
constexpr CUtensorMapDataType kTensorMapType =
    std::is_same_v<Element, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                    : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;

// Zero fill outside the tensor (FLOAT_OOB_FILL_NONE), no interleave, and
// L2 fetches of 256 bytes (rows of the tiles used here are 128 bytes).
inline CUtensorMap make_tensor_map(CUtensorMapDataType element_type, const void* base,
                                   const TensorMapLayout& layout, CUtensorMapSwizzle swizzle) {
  static const auto encode =
      driver_api::driver_function<PFN_cuTensorMapEncodeTiled_v12000>("cuTensorMapEncodeTiled", 12000);
  CUtensorMap map;
  const cuuint32_t element_strides[5] = {1, 1, 1, 1, 1};
  const CUresult status =
      encode(&map, element_type, layout.rank, const_cast<void*>(base), layout.dims,
             layout.strides_bytes, layout.box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
             swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (status != CUDA_SUCCESS) {
    throw RuntimeError("cuTensorMapEncodeTiled(rank " + std::to_string(layout.rank) +
                       ") failed: " + driver_api::driver_error_name(status) + " (CUresult " +
                       std::to_string(static_cast<int>(status)) + ")");
  }
  return map;
}

// A row-major [rows, k] matrix of a 16-bit Element (the K-major operand
// of a GEMM), rows `ld` elements apart, in 128-byte-swizzled boxes of 64 k
// (one swizzle row) x box_rows rows.
template <typename Element>
CUtensorMap k_major_map(const void* base, std::int64_t k, std::int64_t ld, std::int64_t rows,
                        int box_rows) {
  static_assert(sizeof(Element) == 2, "boxes of 64 k are 128-byte rows of 16-bit elements");
  TensorMapLayout layout;
  layout.rank = 2;
  layout.dims[0] = static_cast<cuuint64_t>(k);
  layout.dims[1] = static_cast<cuuint64_t>(rows);
  layout.strides_bytes[0] = static_cast<cuuint64_t>(ld) * sizeof(Element);
  layout.box[0] = 64;
  layout.box[1] = static_cast<cuuint32_t>(box_rows);
  return make_tensor_map(kTensorMapType<Element>, base, layout, CU_TENSOR_MAP_SWIZZLE_128B);
}

// ---- device ----

// Copies the box at (c0, c1) of a 2-D map to the same shared-memory offset
// in every CTA of the cluster named in `cta_mask`, completing on the
// mbarrier at `barrier`'s offset in each of them (sm_90a).
__device__ __forceinline__ void tma_load_multicast(void* shared_destination,
                                                   const CUtensorMap* map, std::int32_t c0,
                                                   std::int32_t c1, std::uint64_t* barrier,
                                                   std::uint16_t cta_mask) {
  const std::int32_t coordinates[2] = {c0, c1};
  ::cuda::ptx::cp_async_bulk_tensor(::cuda::ptx::space_cluster, ::cuda::ptx::space_global,
                                    shared_destination, map, coordinates, barrier, cta_mask);
}

// Copies `bytes` (a multiple of 16) of contiguous global memory at `source`
// (16-byte aligned) into shared memory, completing on `barrier`.
__device__ __forceinline__ void bulk_load(void* shared_destination, const void* source,
                                          std::uint32_t bytes, std::uint64_t* barrier) {
  ::cuda::ptx::cp_async_bulk(::cuda::ptx::space_cluster, ::cuda::ptx::space_global,
                             shared_destination, source, bytes, barrier);
}

// bulk_load into the same shared-memory offset of every CTA of the cluster
// named in `cta_mask`, completing on the mbarrier at `barrier`'s offset in
// each of them (sm_90a).
__device__ __forceinline__ void bulk_load_multicast(void* shared_destination, const void* source,
                                                    std::uint32_t bytes, std::uint64_t* barrier,
                                                    std::uint16_t cta_mask) {
  ::cuda::ptx::cp_async_bulk(::cuda::ptx::space_cluster, ::cuda::ptx::space_global,
                             shared_destination, source, bytes, barrier, cta_mask);
}

// Copies the box at (c0, c1) of a 2-D map into shared memory.
__device__ __forceinline__ void tma_load(void* shared_destination, const CUtensorMap* map,
                                         std::int32_t c0, std::int32_t c1,
                                         std::uint64_t* barrier) {
  const std::int32_t coordinates[2] = {c0, c1};
  ::cuda::ptx::cp_async_bulk_tensor(::cuda::ptx::space_cluster, ::cuda::ptx::space_global,
                                    shared_destination, map, coordinates, barrier);
}

// Copies the box at (c0, c1, c2) of a 3-D map into shared memory.
__device__ __forceinline__ void tma_load(void* shared_destination, const CUtensorMap* map,
                                         std::int32_t c0, std::int32_t c1, std::int32_t c2,
                                         std::uint64_t* barrier) {
  const std::int32_t coordinates[3] = {c0, c1, c2};
  ::cuda::ptx::cp_async_bulk_tensor(::cuda::ptx::space_cluster, ::cuda::ptx::space_global,
                                    shared_destination, map, coordinates, barrier);
}

// Copies the box at (c0, c1, c2, c3) of a 4-D map into shared memory.
__device__ __forceinline__ void tma_load(void* shared_destination, const CUtensorMap* map,
                                         std::int32_t c0, std::int32_t c1, std::int32_t c2,
                                         std::int32_t c3, std::uint64_t* barrier) {
  const std::int32_t coordinates[4] = {c0, c1, c2, c3};
  ::cuda::ptx::cp_async_bulk_tensor(::cuda::ptx::space_cluster, ::cuda::ptx::space_global,
                                    shared_destination, map, coordinates, barrier);
}

// Writes a shared-memory box to (c0, c1, c2) of a 3-D map; elements outside
// the tensor are skipped. Joins the issuing thread's open bulk group.
__device__ __forceinline__ void tma_store(const CUtensorMap* map, std::int32_t c0,
                                          std::int32_t c1, std::int32_t c2,
                                          const void* shared_source) {
  const std::int32_t coordinates[3] = {c0, c1, c2};
  ::cuda::ptx::cp_async_bulk_tensor(::cuda::ptx::space_global, ::cuda::ptx::space_shared, map,
                                    coordinates, shared_source);
}

// Copies `bytes` (a multiple of 16) of shared memory to contiguous global
// memory at `destination` (16-byte aligned). Joins the issuing thread's
// open bulk group.
__device__ __forceinline__ void bulk_store(void* destination, const void* shared_source,
                                           std::uint32_t bytes) {
  ::cuda::ptx::cp_async_bulk(::cuda::ptx::space_global, ::cuda::ptx::space_shared, destination,
                             shared_source, bytes);
}

// Adds `bytes` (a multiple of 16) of fp32 values in shared memory to those
// at `destination` (16-byte aligned) in global memory, element by element
// (round to nearest; fp32 subnormals may flush to zero). Joins the issuing thread's
// open bulk group.
__device__ __forceinline__ void bulk_reduce_add(float* destination, const float* shared_source,
                                                std::uint32_t bytes) {
  ::cuda::ptx::cp_reduce_async_bulk(::cuda::ptx::space_global, ::cuda::ptx::space_shared,
                                    ::cuda::ptx::op_add, destination, shared_source, bytes);
}

// Closes the issuing thread's open bulk group (its stores since the last commit).
__device__ __forceinline__ void bulk_commit_group() { ::cuda::ptx::cp_async_bulk_commit_group(); }

// Waits until at most kPending of this thread's bulk groups are still
// reading their shared-memory source (the source may then be overwritten).
template <int kPending>
__device__ __forceinline__ void bulk_wait_group_read() {
  ::cuda::ptx::cp_async_bulk_wait_group_read(::cuda::ptx::n32_t<kPending>{});
}

// Waits until at most kPending of this thread's bulk groups are incomplete.
template <int kPending>
__device__ __forceinline__ void bulk_wait_group() {
  ::cuda::ptx::cp_async_bulk_wait_group(::cuda::ptx::n32_t<kPending>{});
}

// Orders this thread's global-memory accesses through the generic proxy
// (ordinary loads and stores) with its later ones through the async proxy
// (TMA), and the reverse. Data one CTA stores and another reads with TMA
// crosses both proxies: the writer fences before it signals, the reader
// after it sees the signal.
__device__ __forceinline__ void fence_async_global() {
  ::cuda::ptx::fence_proxy_async(::cuda::ptx::space_global);
}

// Orders this thread's earlier generic-proxy shared-memory accesses before
// later async-proxy (TMA, wgmma) accesses; a barrier must follow before
// another thread issues the copy.
__device__ __forceinline__ void fence_async_shared() {
  ::cuda::ptx::fence_proxy_async(::cuda::ptx::space_shared);
}

}  // namespace ikbo::detail::cuda::ptx
