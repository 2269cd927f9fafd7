// src/cuda/sm90/linear_sm90.hpp — the Hopper (sm_90a) path of linear: the
// candidate GEMM on TMA + wgmma (the warp-specialized pipeline), with the
// user partial and the bias added to its fp32 accumulators in the epilogue
// (see linear_sm90.cu).
//
// Dispatch rule. The CUDA backend's linear() (portable/linear_cublas.cu)
// takes this path when linear_sm90_eligible() accepts the call:
//   - the plan's device is compute capability 9.0 and the binary carries the
//     sm_90a kernels (linear_sm90_available), and the dtype is f16 or bf16
//     (f32 stays on cuBLAS): then the plan holds the kernel's weight tensor
//     maps (linear_sm90_weight_maps);
//   - Kc and Ku multiples of 8, x_c and x_u 16-byte aligned (both are read
//     in place by TMA, whose row strides must be multiples of 16 bytes);
//   - B, N_out and Kc within the kernel's int32 coordinates;
//   - the path is enabled (IKBO_DISABLE_SM90 unset or "0");
//   - a workspace of linear_workspace_bytes (always the case through the API).
// Every other call runs the cuBLAS path (linear_decomposed: user GEMM,
// candidate GEMM, combine). linear_workspace_bytes is that path's size,
// which covers this path's needs (the user partials and a counter) too.
// Plain C++ so that tests can include it.
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "backend.hpp"

namespace ikbo::detail::cuda {

// The device is compute capability 9.0 and this binary carries the sm_90a
// linear kernels.
bool linear_sm90_available(Device device);

// The tensor maps of a prepared CUDA plan's weights (plan.w_u, plan.w_c set)
// for every tile of the Hopper kernel, or null where it cannot take the
// plan (not available on its device, or not f16/bf16).
std::shared_ptr<const WeightTensorMaps> linear_sm90_weight_maps(const LinearPlan::State& plan);

// Whether the Hopper kernel takes these shapes, whatever the call's pointers
// (see the dispatch rule above).
bool linear_sm90_supported(const LinearPlan::State& plan, std::int64_t num_candidates);

// linear_sm90_supported, the path is enabled, x_c and x_u are 16-byte
// aligned and a workspace is there.
bool linear_sm90_eligible(const LinearArgs& args);

// The output tile one CTA computes: `rows` candidates x `features` outputs.
struct LinearSm90Tile {
  int rows = 0, features = 0;
};
// Every tile the kernel is built for.
std::span<const LinearSm90Tile> linear_sm90_tiles();
// The tile linear() uses on these shapes: chosen from the shapes unless
// forced (below).
LinearSm90Tile linear_sm90_tile(const LinearPlan::State& plan, std::int64_t num_candidates,
                                std::int64_t num_users);
// Tests and measurements: force tile linear_sm90_tiles()[index], or -1 for
// the shape-based choice (the default, unless the environment sets
// IKBO_LINEAR_SM90_TILE to an index).
void set_linear_sm90_forced_tile(int index);
int linear_sm90_forced_tile();

// Scratch of one call, in the caller's workspace.
struct LinearSm90Workspace {
  float* user_partials = nullptr;  // [U, N_out] fp32, 16-byte aligned
  int* users_done = nullptr;       // one counter
};

// linear on args.stream in one launch: the user partials
// P = x_u @ w_u^T, then out[b] = round(x_c[b] @ w_c^T + (P[u(b)] + bias)).
// `args` must be eligible.
void linear_sm90(const LinearArgs& args, const LinearSm90Workspace& workspace);

// The path is enabled unless the environment has IKBO_DISABLE_SM90 set to
// anything but "" or "0" (read once). Tests switch it to compare with the
// cuBLAS path; switching does not change workspace sizes.
bool linear_sm90_enabled();
void set_linear_sm90_enabled(bool enabled);

}  // namespace ikbo::detail::cuda
