// src/cuda/sm90/lce_sm90.hpp — the Hopper (sm_90a) LCE path: TMA + wgmma
// kernels on the warp-specialized pipeline, with the gather-add of the user
// partial fused into the candidate GEMM's epilogue (see lce_sm90.cu).
//
// The CUDA backend's lce() (portable/lce_cublas.cu) takes this path when
// lce_sm90_eligible() says so and falls back to cuBLAS otherwise; its
// workspace size covers both. Plain C++ so that tests can include it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "backend.hpp"

namespace ikbo::detail::cuda {

// The device is compute capability 9.0 and this binary carries the sm_90a
// kernels (a build without sm_90a code, or one JIT-compiled from PTX for
// another target, has none).
bool lce_sm90_available(Device device);

// The tensor maps of a prepared CUDA plan's weights (plan.w_u, plan.w_c
// set) for the Hopper kernels, or null where they cannot take the plan:
// not available on its device, not f16/bf16, or no user term (Ku = 0).
std::shared_ptr<const WeightTensorMaps> lce_sm90_weight_maps(const LcePlan::State& plan);

// Whether the Hopper kernels take these shapes, whatever the call's
// pointers: the plan has their weight maps (above), N is a multiple of 8
// (TMA needs 16-byte row strides), and sizes stay within the kernels'
// int32 coordinates.
bool lce_sm90_supported(const LcePlan::State& plan, std::int64_t n, std::int64_t num_candidates,
                        std::int64_t num_users);

// Workspace of the Hopper path: the fp32 user partials in the kernels'
// fragment order.
std::size_t lce_sm90_workspace_bytes(const LcePlan::State& plan, std::int64_t n,
                                     std::int64_t num_users);

// lce_sm90_supported, the path is enabled, e_c, e_u and out are 16-byte
// aligned, and the workspace is large enough.
bool lce_sm90_eligible(const LceArgs& args);

// How the user tiles are scheduled:
//   one_launch         user and candidate tiles in one persistent launch, the
//                      candidate epilogues waiting on per-tile ready flags
//                      (the default path);
//   user_launch_first  the user tiles in a launch of their own, then the
//                      candidate GEMM with the user add in its epilogue (the
//                      "fused" stage of the published staircase, kept for
//                      the benchmark).
enum class LceSm90Schedule { one_launch, user_launch_first };

// Runs lce on the Hopper path; `args` must be eligible.
void lce_sm90(const LceArgs& args, LceSm90Schedule schedule = LceSm90Schedule::one_launch);

// The path is enabled unless the environment has IKBO_DISABLE_SM90 set to
// anything but "" or "0" (read once, at the first query). Tests switch it to
// compare with the cuBLAS path; switching does not change workspace sizes.
bool lce_sm90_enabled();
void set_lce_sm90_enabled(bool enabled);

}  // namespace ikbo::detail::cuda
