// GPU-side test numerics for problems too large for host references (the
// published LCE and attention grids at B up to 2048): inputs generated on
// the device, an fp32 attention reference computed there, and outputs
// compared on the device, so nothing of B x M x N size crosses to the host.
// Implemented in device_numerics.cu, built with CUDA only; tests call these
// after skipping where CUDA is missing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "ikbo/tensor.hpp"

namespace ikbo::test {

// values[i] = a uniform value in [-scale, scale) drawn from (seed, i) by a
// hash, rounded to `dtype`; when `values_f32` is not null it receives the
// same rounded values in fp32 (an exact conversion). Device pointers on the
// current CUDA device; synchronous.
void fill_uniform_on_device(void* values, DType dtype, float* values_f32, std::int64_t count,
                            float scale, std::uint64_t seed);

// max_i |actual[i] - expected[i]| over `count` elements, `actual` in `dtype`
// and `expected` in fp32 (device pointers); a NaN difference counts as
// infinity. Synchronous.
double max_abs_difference_on_device(const void* actual, DType dtype, const float* expected,
                                    std::int64_t count);

// Sets every byte of `bytes` at `values` to 0xff: a NaN in f16, bf16 and
// f32 alike, so an op must overwrite all of it. Synchronous.
void poison_on_device(void* values, std::size_t bytes);

// Waits for the device; a failure of earlier asynchronous work (a kernel
// fault) is thrown as ikbo::RuntimeError naming `after`.
void synchronize_device(const char* after);

// Attention in fp32 on the GPU, as an oracle for shapes whose fp64 host
// reference would take minutes: per head, the scores of every candidate's
// n_seed queries against its user's keys (cuBLAS SGEMM, batched over the
// candidates, TF32 and reduced-precision reductions off), a row softmax of
// the materialized scores in fp32, and P V (SGEMM). Deliberately not a flash
// attention: nothing is shared with the kernels under test but the math.
//   q, out [B, n_seed, H, D]; k, v rows [rows, H, D] where user u owns rows
//   kv_offsets[u] .. kv_offsets[u+1] (dense [U, S, H, D] is offsets u * S);
//   a user with no rows gets zeros. Device pointers, fp32; cand_to_user and
//   kv_offsets on the host.
// Holds its cuBLAS handle and grows its scratch (scores of one head, the
// batched GEMMs' pointer arrays) to the largest call, so a grid of calls
// allocates once. Runs on the legacy default stream; synchronous.
class DeviceAttentionReference {
 public:
  DeviceAttentionReference();
  ~DeviceAttentionReference();
  DeviceAttentionReference(const DeviceAttentionReference&) = delete;
  DeviceAttentionReference& operator=(const DeviceAttentionReference&) = delete;

  void run(const float* q, const float* k, const float* v, float* out,
           std::span<const std::int32_t> cand_to_user, std::span<const std::int64_t> kv_offsets,
           std::int64_t n_seed, std::int64_t heads, std::int64_t head_dim, float scale);

 private:
  struct Resources;
  std::unique_ptr<Resources> resources_;
};

}  // namespace ikbo::test
