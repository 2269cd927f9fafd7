// src/cuda/sm90/attention_sm90.hpp — the Hopper (sm_90a) attention path: a
// persistent, warp-specialized flash-attention kernel whose 128-row query
// tiles are cut from the concatenated query rows of one user's candidates,
// so every K/V block is loaded once per tile and shared by all candidates
// in it (see attention_sm90.cu).
//
// The CUDA backend's attention() (portable/attention_portable.cu) takes this
// path when attention_sm90_eligible() says so and falls back to the portable
// mma.sync kernel otherwise. Plain C++ so that tests can include it.
#pragma once

#include <cstddef>

#include "backend.hpp"

namespace ikbo::detail::cuda {

// The device is compute capability 9.0 and this binary carries the sm_90a
// kernels.
bool attention_sm90_available(Device device);

// Whether the Hopper kernel takes this call, whether or not the path is
// enabled: available on the map's device, f16/bf16, D in {64, 128, 256},
// q, k, v and out 16-byte aligned, at least one K/V row in the tensor (a
// tensor map cannot describe an empty one), and sizes within the kernel's
// int32 coordinates and unit count.
bool attention_sm90_supported(const AttentionArgs& args);

// attention_sm90_supported and the path is enabled.
bool attention_sm90_eligible(const AttentionArgs& args);

// How the two consumer warpgroups share the tensor cores:
//   ping_pong    they take turns issuing their GEMMs (named barriers), so
//                one warpgroup's softmax runs while the other's GEMMs do;
//   cooperative  each issues as soon as its operands are ready;
//   *_lookahead  the same, and each warpgroup runs a unit's epilogue only
//                after it has issued the next unit's first QK^T, so the
//                tensor cores work through the epilogue (D <= 128: at
//                D = 256 the schedule runs without the look-ahead).
// All overlap the softmax of block j with the QK^T of block j + 1 inside a
// warpgroup. Results are bitwise identical between them. Measured on H100
// (reference shape, fp16, S = 512 .. 8192): the look-ahead adds 2-4%, and
// ping-pong brings nothing on top of the in-warpgroup overlap, so
// cooperative_lookahead is the default. The default schedule alone has
// kernels of its own for dense K/V in whole blocks at D = 128 (no masked
// last block) and for jagged K/V of few users (length_order_users in
// attention_sm90.cu, walked longest user first); the others take every
// call with the general kernel and walk in the users' order.
enum class AttentionSm90Schedule {
  ping_pong,
  cooperative,
  ping_pong_lookahead,
  cooperative_lookahead
};

// Bytes of workspace the Hopper path can use for `args` (supported): nonzero
// when the call's query tiles would leave more than half of the SMs idle.
// Given that much workspace (args.workspace), each tile's keys are then
// split into ranges run by CTAs of their own, whose partial results are
// combined after (a second launch); without it the call runs unsplit.
std::size_t attention_sm90_workspace_bytes(const AttentionArgs& args);

// Runs attention on the Hopper path; `args` must be supported.
void attention_sm90(const AttentionArgs& args, AttentionSm90Schedule schedule);

// The path is enabled unless the environment has IKBO_DISABLE_SM90 set to
// anything but "" or "0" (the variable that switches the Hopper LCE path
// off too; read once, at the first query). Tests switch it to compare with
// the portable kernel.
bool attention_sm90_enabled();
void set_attention_sm90_enabled(bool enabled);

// The schedule attention() uses on this path: cooperative_lookahead unless
// the environment's IKBO_ATTENTION_SM90_SCHEDULE names another (ping_pong,
// cooperative, ping_pong_lookahead; read once).
AttentionSm90Schedule attention_sm90_schedule();
void set_attention_sm90_schedule(AttentionSm90Schedule schedule);

// The fewest K/V blocks (128 keys at D <= 128, 64 at D = 256) a key range
// of a split call may have: 8 (below it the second launch costs more than
// the idle SMs). Tests lower it to split small problems.
int attention_sm90_min_range_blocks();
void set_attention_sm90_min_range_blocks(int blocks);

// The fewest rounds of tall units (192 query rows each, on every SM) for
// which the default schedule runs them at D = 128, when set; -1 (the
// default) leaves the library's rule: 4 for jagged K/V, 10 for dense K/V
// whose length is not a multiple of 128 (a call of fewer loses more to its
// last round than tall units save). Tests set 0 to run them on small
// problems.
int attention_sm90_tall_min_rounds();
void set_attention_sm90_tall_min_rounds(int rounds);

}  // namespace ikbo::detail::cuda
