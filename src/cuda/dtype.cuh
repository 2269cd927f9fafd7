// src/cuda/dtype.cuh — the element types behind ikbo::DType on the device:
// the C++ type of each floating dtype, conversions to and from the fp32 the
// kernels compute in, vectors of elements for wide loads and stores, the
// matching cudaDataType, and the one switch that turns a runtime DType into
// a compile-time element type.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <library_types.h>

#include <string>
#include <type_traits>

#include "ikbo/error.hpp"
#include "ikbo/tensor.hpp"

namespace ikbo::detail::cuda {

template <typename Element>
__device__ __forceinline__ float to_float(Element value) {
  if constexpr (std::is_same_v<Element, __half>) {
    return __half2float(value);
  } else if constexpr (std::is_same_v<Element, __nv_bfloat16>) {
    return __bfloat162float(value);
  } else {
    return value;
  }
}

// Round to nearest even, the rounding every ikbo output uses.
template <typename Element>
__device__ __forceinline__ Element from_float(float value) {
  if constexpr (std::is_same_v<Element, __half>) {
    return __float2half_rn(value);
  } else if constexpr (std::is_same_v<Element, __nv_bfloat16>) {
    return __float2bfloat16_rn(value);
  } else {
    return value;
  }
}

// kVector elements moved as one load or store, aligned to their whole size.
template <typename Element, int kVector>
struct alignas(sizeof(Element) * kVector) Vector {
  Element lanes[kVector];
};

inline cudaDataType_t cuda_data_type(DType dtype) {
  switch (dtype) {
    case DType::f16: return CUDA_R_16F;
    case DType::bf16: return CUDA_R_16BF;
    case DType::f32: return CUDA_R_32F;
    case DType::i32: return CUDA_R_32I;
  }
  throw RuntimeError("cuda_data_type: unknown dtype");
}

// Calls fn(Element{}) with the element type of a floating dtype. The API
// layer only lets floating dtypes through; i32 reaching here is a bug.
template <typename Fn>
decltype(auto) dispatch_float_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::f16: return fn(__half{});
    case DType::bf16: return fn(__nv_bfloat16{});
    case DType::f32: return fn(float{});
    case DType::i32: break;
  }
  throw RuntimeError(std::string("CUDA backend: no kernel for dtype ") + dtype_name(dtype));
}

}  // namespace ikbo::detail::cuda
