// src/cuda/sm90/attention_sm90.cu — IKBO attention forward on Hopper: a
// persistent, warp-specialized flash-attention kernel (TMA, wgmma,
// setmaxnreg) on the pipeline of sm90/pipeline.cuh, in which every query
// tile belongs to one user and reads that user's K/V in place.
//
//   out[b, :, h, :] = softmax(scale * q[b,:,h,:] @ k[u,:,h,:]^T) @ v[u,:,h,:],  u = cand_to_user[b]
//
// Layouts (elements, row-major): q/out [B, n_seed, H, D]; K/V dense
// [U, S, H, D] or jagged [total, H, D] with user u owning rows
// kv_offsets[u] .. kv_offsets[u+1]. D is 64, 128 or 256; f16 or bf16.
//
// Work units. The query rows of user u are the n_seed rows of each of its
// candidates in candidates_by_user order (row r is seed r % n_seed of
// candidate candidates_by_user[user_offsets[u] + r / n_seed]), exactly as
// in the portable kernel. A unit is (user, head, tile of 128 of those
// rows): all candidates in the tile share every K/V block it loads, and an
// odd count or n_seed costs at most one partial tile per user. Units are
// numbered slot * H + head, and user u owns the slots
//   [floor(user_offsets[u] * n_seed / 128) + u, that of u + 1),
// at least the ceil(count_u * n_seed / 128) tiles it needs (at most one
// slot more: an empty unit, which costs a zero-filled Q slot and no K/V),
// so a unit finds its user by binary search over user_offsets with no
// per-call table. The producer and the loaders decode each unit that way;
// the consumers read the loaders' description from the unit's Q slot.
// Jagged K/V of few users (length_order_users) is walked instead in
// decreasing order of the users' lengths and in snake rounds, through a
// table the producer warpgroup builds in shared memory at the start
// (kLengthOrder, prepare_walk), so that the CTAs' loads even out. At
// D = 128, dense K/V whose length is a multiple of the K/V block runs a
// kernel without the masked last block and the fixer (kWholeBlocks).
// Consecutive units are the heads and tiles of one user: the persistent
// grid (CTA c takes units c, c + grid, ...) runs a user's units side by
// side, and its K/V comes from DRAM once and from L2 after.
//
// Split keys: a call whose query tiles would leave more than half of the
// SMs idle (key_ranges), given a workspace, runs SplitKeysKernel instead:
// its units are ranges of a tile's K/V blocks (unit tile * splits + range,
// each range handled as if its keys were all of its user's), each storing
// O unnormalized in fp32 with its rows' maxima and sums (store_partial);
// a second launch (combine_split_keys) weighs the ranges by their maxima,
// sums them in range order, normalizes and rounds into out.
//
// CTA = 3 warpgroups (pipeline.cuh): a producer, two consumers of 64 query
// rows each. Shared memory, all tiles in the 128-byte swizzle (16-byte
// chunk c of a 128-byte row r at chunk c ^ (r % 8), D split into column
// blocks of 64 elements [D/64][rows][64], every tile 1024-byte aligned):
//   K/V ring   kStages stages of one block of kBlockN keys (128; 64 at
//              D = 256, whose O takes 128 registers per thread), K and V
//              blocks in alternate k-steps (K_0, V_0, K_1, V_1, ..., or K a
//              block ahead at D = 256: key_step) so that QK^T of block j
//              may start before V_j has landed and each block is released
//              as soon as its own product retired. Thread 0 of the
//              producer fills it with TMA: boxes {64 d, 1 head, kBlockN
//              keys(, 1 user)} through a 4-D map {D, H, S, U} (dense: keys
//              past S arrive as zeros, the next user is never read) or a
//              3-D map {D, H, rows} (jagged: a user's last block ends at
//              its last key, overlapping the block before, whose keys its
//              softmax masks; a user with fewer than kBlockN keys has one
//              block, whose rows past the user's end are the next user's,
//              or zeros past the tensor: producer warp 3, the pipeline's
//              fixer (kTall: the consumers), clears those V rows before
//              the consumers read them).
//   Q ring     2 slots of one unit's 128 x D query tile (192 x D: kTall),
//              and beside the tiles each slot's row of q/out for every
//              tile row (-1: past the user's rows) and the unit's
//              description (every unit has a slot, empty or not).
//              Query rows come from several candidates, so producer warps
//              1-2 (1-3: kTall) gather them with 16-byte cp.async (rows
//              past the user's rows zero-filled), wait, fence.proxy.async
//              (wgmma reads through the async proxy what cp.async wrote
//              through the generic one) and arrive on the slot's barrier. Double
//              buffering lets the next unit's gather overlap this unit.
//   O staging  each consumer warpgroup stages its normalized output in its
//              own 64 rows of the unit's Q slot once its last QK^T retired
//              (stmatrix, conflict-free in the swizzle), then stores whole
//              16-byte chunks of the rows that exist; the slot goes back to
//              the loaders after that.
//
// Consumer warpgroup, per unit (64 rows, K/V blocks j = 0 .. n-1):
//   S = Q K_0^T (wgmma m64n<kBlockN>k16, both operands in shared memory);
//   softmax(S) -> P; then for j >= 1: issue S = Q K_j^T and, once V_{j-1}
//   has landed, O += P V_{j-1} (wgmma with P as the register A operand, V
//   MN-major), wait for both (the tensor pipe takes a warpgroup's wgmmas
//   about as fast as it runs them, so little is left of them by then;
//   the whole-block and tall kernels wait for S alone in blocks whose keys
//   all count and exponentiate under the PV product: kExpsUnderPv),
//   softmax(S) while the other warpgroup's products run, rescale O if a
//   row's maximum grew; finally O += P V_{n-1} and the epilogue. O is
//   started by the unit's first PV product (scale-d = 0), never zeroed by
//   ordinary instructions (see the look-ahead below). The online softmax
//   runs in fp32 on exp2 with scale * log2(e) folded into one FFMA per
//   score; the row maximum is taken on raw scores (their minimum when the
//   scale is negative); keys past the user's length are excluded from it
//   and get P = 0 exactly, so a block of the next user's keys (or TMA's
//   zeros) never contributes, and a user without keys gets O = 0 (never
//   NaN), and the next user's V rows in a jagged user's last block are
//   zeros by the time PV reads them (0 * Inf would be NaN). P is rounded
//   to the input type for PV, as in FlashAttention and the portable
//   kernel; O is normalized and rounded once.
//
// The consumer loop is the kernel's own (pipeline.cuh's kernel-owned
// loop): it walks the CTA's units, acquires each unit's Q slot, waits for
// and releases K/V k-steps out of ring order (K_j and V_{j-1} once S_j and
// P_{j-1} V_{j-1} retired).
//
// Look-ahead (the *_lookahead schedules; at D = 256, which has no registers
// for the copy of O it takes, they run without it): a unit's epilogue is
// deferred until the next unit's first QK^T has been issued, so the tensor
// cores have work while the epilogue's stores run; its Q slot is released
// after it (two slots are then held). The finished O is first copied out of the
// wgmma accumulators with real moves: ptxas cannot tell that the product
// that wrote them retired before a newer one was committed, and would
// otherwise wait for the newer one before the epilogue reads them. No
// ordinary instruction may define accumulator registers while a product is
// in flight (ptxas would serialize every wgmma of the kernel), hence the
// scale-d = 0 start of O.
//
// Tall units (D = 128, default schedule, where keys end inside 128-key
// blocks: jagged K/V, or dense K/V whose length is not a multiple of 128;
// in calls of rounds enough of them, tall_min_rounds): 192-row tiles over
// three consumer warpgroups (512 threads; producer at 24 registers,
// consumers at 160) and K/V blocks of 64 keys, without the look-ahead. A
// user's last block, where its keys end, is half empty on average, and a
// block costs about the same whatever its width, so narrower blocks waste
// less; the third warpgroup hides the extra waits that 64-key blocks cost
// two of them (12-13% slower, bench/notes/attention_sm90.md, session 23).
// H100, session 31, B = 2048: jagged lengths uniform in [S/2, 3S/2] 4.4 /
// 1.9 / 0.6 / 0.5% faster than the two-warpgroup kernels at S = 512 / 1024
// / 2048 / 4096; dense S = 64 / 100 / 200 / 300 / 500 / 1000 / 3000 16 / 10
// / 8.5 / 4.5 / 1.1 / 0.4 / 1.1% faster, 1500 level. A last block whose
// new keys fit in 32 runs over those 32 (session 32: jagged 2.1 / 2.8 /
// 2.5% faster at S = 512 / 1024 / 2048, dense S = 96 / 160 / 288 4.3 / 3.9
// / 2.8%). Dense lengths in whole blocks keep the two-warpgroup kernel
// (level there, and 192-row tiles round B = 2048's units up by more). The
// producer's three spare warps all gather Q, so the consumers clear a short
// user's V rows themselves (fix_up).
//
// Ping-pong (AttentionSm90Schedule::ping_pong): each consumer issues its
// GEMMs of a step only in its turn, named barrier 1 + consumer, and passes
// the turn on by arriving on the other's, so the tensor cores run one
// warpgroup's products while the other computes its softmax (FA3's
// scheduling). Both consumers take the same number of turns (they work on
// the same units), consumer 1 gives the first turn away before its first
// unit and consumer 0 takes the last one back after its last unit, which
// leaves both barriers balanced at exit.
#include "cuda/sm90/attention_sm90.hpp"

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string_view>
#include <type_traits>

#include "cuda/check.cuh"
#include "cuda/dtype.cuh"
#include "cuda/online_softmax.cuh"
#include "cuda/ptx/mbarrier.cuh"
#include "cuda/ptx/sm80.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/ptx/warpgroup.cuh"
#include "cuda/ptx/wgmma.cuh"
#include "cuda/runtime.cuh"
#include "cuda/sm90/device_support.cuh"
#include "cuda/sm90/pipeline.cuh"

namespace ikbo::detail::cuda {
namespace {

using sm90::kSharedAlignment;
using sm90::kWarpgroupThreads;

constexpr int kBlockM = 128;          // query rows per unit
constexpr int kWarpgroupRows = 64;    // of which each consumer warpgroup takes one wgmma M
// Tall units (see the header comment): consumer warpgroups, query rows and
// keys per K/V block.
constexpr int kTallConsumers = 3;
constexpr int kTallRows = kTallConsumers * kWarpgroupRows;
constexpr int kTallBlockN = 64;
constexpr int kSwizzleElements = 64;  // elements per 128-byte swizzle row
constexpr int kSwizzleRowBytes = 128;
constexpr std::uint32_t kAtomBytes = 8 * kSwizzleRowBytes;  // 8-row swizzle atom
constexpr int kWgmmaK = 16;
constexpr int kElementBytes = 2;
constexpr double kLog2e = 1.4426950408889634;
// Lazy rescaling (online_softmax): how large the sum of a block's P over a
// thread's part of a row may grow before the row's maximum is raised and O
// rescaled. 2^15 keeps every P below fp16's largest finite value (65504);
// with 2^8 the kernel ran 11-14% slower on logits of standard deviation 4
// (H100, session 20: the maxima of later blocks overtook the running ones
// by more than 8 in log2 often, and each such block exponentiates twice).
constexpr float kRescaleLimit = 32768.0f;
// Predicted maxima (online_softmax, kFirst): a unit's first block takes as
// its reference the row maxima of the warp's previous unit of the same head
// when every thread's sums of the block's P then lie in [kPredictFloor,
// kRescaleLimit] (so the largest P of each thread's part of a row is at
// least 2^-13, normal in fp16, and none exceeds 2^15); otherwise it computes
// its maxima and its P again, and the warp stops guessing for the next
// kPredictBackoff units. H100, session 21: S = 512 ran 1-2% faster on the
// bench's inputs, 0-1.8% slower on logits of standard deviation 4, where
// most guesses miss (4% slower when guessing again after 3 units).
constexpr float kPredictFloor = 1.0f / 256.0f;
constexpr int kPredictBackoff = 32;
constexpr unsigned kFullWarp = 0xffffffffu;

// Named barriers (0 is __syncthreads): consumer w's ping-pong turn is
// barrier kTurnBarrier + w.
constexpr std::uint32_t kTurnBarrier = 1;
constexpr std::uint32_t kFixBarrier = 3;  // kTall's consumers after clearing V rows
constexpr int kConsumerThreads = 2 * kWarpgroupThreads;

// Keys per K/V block: 128, or 64 at D = 256 (whose O takes 128 of a
// consumer thread's registers).
constexpr int block_keys(std::int64_t head_dim) { return head_dim == 256 ? 64 : 128; }

// Jagged K/V with at most this many users is walked in length order (the
// kLengthOrder kernels). The table takes 8 bytes per user of shared memory
// (and its ranking 128 threads' time, quadratic in the users): at D = 128,
// 96 users fit beside five K/V stages and two Q slots within the 227 KiB
// a block may have; D = 64 has room for more, D = 256 for none.
constexpr int length_order_users(std::int64_t head_dim) {
  return head_dim == 64 ? 256 : head_dim == 128 ? 96 : 0;
}

struct AttentionSm90Params {
  // Boxes {64 d, 1 head, kBlockN keys} (jagged, {D, H, rows}) or
  // {64 d, 1 head, kBlockN keys, 1 user} (dense, {D, H, S, U}).
  CUtensorMap keys, values;
  const void* q;
  void* out;
  const std::int32_t* user_offsets;        // [U + 1]
  const std::int32_t* candidates_by_user;  // [B]
  const std::int32_t* kv_offsets;          // [U + 1]; null: dense K/V
  int num_users, heads, n_seed, dense_seq_len;
  int num_units;
  float scale_log2;  // scale * log2(e)
  // Split keys (kSplitKeys): each query tile's blocks in `splits` ranges,
  // one unit each, whose partial results go to `partials` (the caller's
  // workspace, split_partial_out / split_partial_stat).
  float* partials;
  int splits;
};

// Split keys: the workspace holds, for each unit and query row of its tile,
// O unnormalized in fp32 ([units][kBlockM][D]), then after all of those the
// row's (maximum, sum) pairs ([units][kBlockM]); split_partials_bytes sizes it.
template <int kHeadDim>
__device__ __forceinline__ float* split_partial_out(const AttentionSm90Params& params,
                                                    std::int64_t unit, int row) {
  return params.partials + (unit * kBlockM + row) * kHeadDim;
}

template <int kHeadDim>
__device__ __forceinline__ float2* split_partial_stat(const AttentionSm90Params& params,
                                                      std::int64_t unit, int row) {
  float* const stats = params.partials + std::int64_t{params.num_units} * kBlockM * kHeadDim;
  return reinterpret_cast<float2*>(stats) + unit * kBlockM + row;
}

// One unit, decoded by the producer and by the loaders
// (AttentionSm90Kernel::describe), which pass it on to the consumers. All
// int32, as query rows and K/V rows are (attention_sm90_supported): each Q
// slot keeps a copy beside five K/V stages at D = 128, with bytes to spare.
struct AttentionUnit {
  int head = 0;
  int user = 0;
  int rows = 0;         // query rows of the tile, 0 .. kBlockM (0: an empty unit)
  int blocks = 0;       // K/V blocks to walk (0 when rows == 0 or the user has no keys)
  int kv_length = 0;    // the user's keys
  int group_begin = 0;  // first entry of the user's group in candidates_by_user
  int first_row = 0;    // first of the tile's rows among the user's query rows
  // The first K/V row of the unit's keys: jagged, in the tensor; dense, in
  // the user's keys (0 unless the keys are split).
  int kv_row = 0;
};

// threadIdx.x, read where it is used: a volatile read cannot be hoisted out
// of the unit loop.
__device__ __forceinline__ int thread_index_here() {
  int index;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(index));
  return index;
}

// Byte offset of 16-byte chunk `chunk` (0 .. D/8) of row `row` in a
// [D/64][kRows][64] tile with the 128-byte swizzle.
template <int kRows>
__device__ __forceinline__ std::uint32_t tile_offset(int row, int chunk) {
  return static_cast<std::uint32_t>((chunk / 8) * (kRows * kSwizzleRowBytes) +
                                    row * kSwizzleRowBytes + (((chunk % 8) ^ (row % 8)) << 4));
}

// Byte offset of k16 slice `slice` of a K-major [D/64][kRows][64] operand:
// four 32-byte slices per swizzle row, then the next column block.
template <int kRows>
__device__ __forceinline__ std::uint32_t k_slice_offset(int slice) {
  return static_cast<std::uint32_t>((slice / 4) * (kRows * kSwizzleRowBytes) + (slice % 4) * 32);
}

// Where the masked softmax of a unit's last block stays out of the block
// loop (its code alone, present in the loop and never taken, cost the dense
// kernel 0.3-1.2%): kWholeBlocks kernels, for dense K/V whose length is a
// multiple of kBlockN, have no masked softmax and no fixer warp, and the
// other kernels run the last block after the loop. D = 128 only: at D = 256
// both layouts ran 7-10% slower and at D = 64 within +-2% (H100, session 20),
// so D = 64 and 256 keep the masked softmax in the loop.
constexpr bool tail_out_of_loop(std::int64_t head_dim) { return head_dim == 128; }

// The last block's softmax in the loop, masked where the user's keys end
// inside it (the loop of D = 64 and 256).
struct MaskWhereKeysEnd {};

template <typename Element, int kHeadDim, bool kPingPong, bool kLookahead,
          bool kLengthOrder = false, bool kWholeBlocks = false, bool kSplitKeys = false,
          int kConsumers = 2>
struct AttentionSm90Kernel {
  // kConsumers = 3 (kTall, D = 128 where keys end inside 128-key blocks;
  // see the header comment): 192-row tiles over three consumer warpgroups
  // and 64-key blocks, without the look-ahead, whose copy of O the
  // consumers' 160 registers have no room for.
  static constexpr bool kTall = kConsumers == kTallConsumers;
  static_assert(!kTall || (kHeadDim == 128 && !kPingPong && !kLookahead && !kSplitKeys &&
                           !kWholeBlocks));
  static constexpr int kConsumerWarpgroups = kConsumers;
  static constexpr int kTileRows = kWarpgroupRows * kConsumers;
  static constexpr int kClusterSize = 1;
  static constexpr int kBlockN = kTall ? kTallBlockN : block_keys(kHeadDim);
  // K/V stages of 16 KiB (D = 64, kTall) or 32 KiB (D = 128, 256). kTall
  // fills what its two 48 KiB Q slots leave (seven stages beside the walk
  // table of kLengthOrder). At D = 128 a fifth stage lets the next unit's
  // V_0 load while this unit's last blocks are in use (H100, same call:
  // +1.2-1.4% at S = 512 and 1024, level at 2048, -0.5% at 4096;
  // bench/notes/attention_sm90.md, session 19).
  static constexpr int kStages =
      kTall ? (kLengthOrder ? 7 : 8) : kHeadDim == 64 ? 8 : kHeadDim == 128 ? 5 : 3;
  static constexpr int kUnitStages = 2;
  static constexpr int kUnitLoaderWarps = kConsumers;
  static constexpr bool kOwnsConsumerLoop = true;
  // kTall: a loader warp per consumer warpgroup takes all three warps the
  // producer has beside the TMA thread's, and the consumers clear the V rows
  // of a short jagged user's block themselves (fix_up).
  static constexpr bool kFixUpWarp = !kWholeBlocks && !kTall;
  // Exponentials under PV (at D = 128, the default schedule's whole-block
  // and tall kernels, in the blocks whose keys all count: D = 64 masks
  // every block where keys end, D = 256 has no look-ahead; the kernels with
  // a fixer warp would order its zeros after the consumers' ordinary reads
  // of a stage only through the copies, which racecheck cannot see): block j
  // waits for its QK^T alone, exponentiates the scores in place while
  // PV_{j-1} still runs, and rounds P into the PV operand once that product
  // has retired (FlashAttention-3's order). A warp whose P fails the
  // lazy-rescaling check computes its scores again with mma.sync (its K
  // block is still held; a wgmma would need the whole warpgroup to fail)
  // and takes the exact path. H100, session 34 (same call, two passes):
  // S = 512 / 1024 / 2048 / 4096 +0.4-1.2 / 1.2-1.3 / 1.4-1.7 / 1.8-2.1%,
  // bf16 at 2048 +1.7%, logits of standard deviation 4 level to +0.6%.
  // Session 35, the tall kernels (three passes on two GPUs): jagged
  // S = 512 / 1024 / 2048 +0.5-1.8 / 1.5-2.0 / 1.8-2.2%, dense tails
  // S = 500 / 1000 +2.3-3.0%, 3000 +2.4%. In the cooperative kernel without
  // the look-ahead ptxas serializes the wgmmas (C7511).
  static constexpr bool kExpsUnderPv = (kWholeBlocks && kLookahead && !kPingPong) || kTall;
  static_assert(!(kLengthOrder && kWholeBlocks), "the length order is for jagged K/V");
  static_assert(!kSplitKeys || !(kPingPong || kLookahead || kLengthOrder || kWholeBlocks),
                "split keys run the cooperative schedule's general kernel");
  static_assert(!kWholeBlocks || tail_out_of_loop(kHeadDim));
  // 128 x 40 + 256 x 232 (kTall: 128 x 24 + 384 x 160) <= 64K registers of the SM.
  static constexpr int kProducerRegisters = kTall ? 24 : 40;
  static constexpr int kConsumerRegisters = kTall ? 160 : 232;

  static constexpr int kColumnBlocks = kHeadDim / kSwizzleElements;
  static constexpr int kChunksPerRow = kHeadDim / 8;
  static constexpr int kScoreRegisters = kBlockN / 2;  // m64n<kBlockN> fp32 fragment per thread
  static constexpr int kOutRegisters = kHeadDim / 2;   // m64nD fp32 fragment per thread
  static constexpr int kQkSlices = kHeadDim / kWgmmaK;
  static constexpr int kPvSlices = kBlockN / kWgmmaK;
  // PV in products of at most 128 columns of O (wgmma_rs's widest).
  static constexpr int kPvColumns = kHeadDim < 128 ? kHeadDim : 128;

  using Params = AttentionSm90Params;
  using UnitInfo = AttentionUnit;
  struct Stage {
    Element tile[kColumnBlocks][kBlockN * kSwizzleElements];  // K or V block [d block][key][64]
  };
  struct QTile {
    Element q[kColumnBlocks][kTileRows * kSwizzleElements];  // [d block][row][64]; later O
  };
  struct UnitMeta {
    std::int32_t row_heads[kTileRows];  // the row of q/out as [B * n_seed * H][D], -1: none
    UnitInfo info;                    // the unit, as the loaders described it
  };
  // The tiles, whose sizes are whole swizzle atoms, from the 1024-byte
  // aligned start; the slots' rows and units after them (at D = 256 the
  // padding of a 1024-aligned slot would not fit in shared memory).
  struct TileStorage {
    Stage stages[kStages];
    QTile q_tiles[kUnitStages];
    UnitMeta unit_meta[kUnitStages];
  };
  // kLengthOrder: the walk's order of users (prepare_walk).
  static constexpr int kOrderedUsers = length_order_users(kHeadDim);
  static_assert(!kLengthOrder || kOrderedUsers > 0, "no room for the length order at this D");
  struct WalkOrder {
    std::int32_t user[kOrderedUsers];            // the user of rank r
    std::int32_t first_slot[kOrderedUsers + 1];  // the walk's first slot of rank r
  };
  struct OrderedStorage : TileStorage {
    WalkOrder walk_order;
  };
  using SharedStorage = std::conditional_t<kLengthOrder, OrderedStorage, TileStorage>;
  static_assert(sizeof(Stage) % kSharedAlignment == 0 &&
                    sizeof(Stage::tile[0]) % kSharedAlignment == 0 &&
                    sizeof(QTile::q[0]) % kSharedAlignment == 0 &&
                    kWarpgroupRows * kSwizzleRowBytes % kSharedAlignment == 0,
                "every TMA box and wgmma operand must start on a 1024-byte swizzle atom");

  // ---- units ----

  // First slot of `user` (see the header comment).
  __device__ static std::int64_t first_slot(const Params& params, int user) {
    return static_cast<std::int64_t>(params.user_offsets[user]) * params.n_seed / kTileRows + user;
  }

  // kLengthOrder (jagged K/V, at most kOrderedUsers users): the walk takes
  // the users in decreasing order of K/V length, users without candidates
  // last, so the longest units come first and the short ones even out the
  // CTAs' loads at the end; and every other full round of the grid runs
  // backwards (snake order), so a CTA that took one of a round's longer
  // units takes one of the next round's shorter ones. A user's slots stay
  // together, so its heads and tiles still run side by side; the empty
  // slots (a user may own one slot more than its tiles) all come last,
  // where they cost nothing. Measured (bench/notes/attention_sm90.md,
  // session 18): +1 to +3% at S = 512 ... 4096 with lengths uniform in
  // [S/2, 3S/2]; modelled: more the more the lengths differ. The table:
  // ranks by counting (thread t ranks users t, t + 128, ...; ties by
  // index), then the tile counts in rank order and their prefix (warp 0);
  // a slot past the last tile describes an empty unit of the last rank.
  __device__ static void prepare_walk(const Params& params, SharedStorage& shared, int thread)
    requires kLengthOrder
  {
    WalkOrder& order = shared.walk_order;
    const int users = params.num_users;
    constexpr int kThreads = kWarpgroupThreads;
    constexpr int kUsersPerThread = (kOrderedUsers + kThreads - 1) / kThreads;
    // The ranking's keys, in first_slot[] until the tile counts replace them.
    for (int u = thread; u < users; u += kThreads) {
      const bool has_rows = params.user_offsets[u + 1] > params.user_offsets[u];
      order.first_slot[u] = has_rows ? params.kv_offsets[u + 1] - params.kv_offsets[u] : -1;
    }
    ptx::named_barrier_sync<kThreads>(sm90::kPrepareWalkBarrier);
    int ranks[kUsersPerThread];
#pragma unroll
    for (int i = 0; i < kUsersPerThread; ++i) {
      const int u = thread + i * kThreads;
      if (u >= users) break;
      const std::int32_t key = order.first_slot[u];
      int rank = 0;
      for (int v = 0; v < users; ++v) {
        const std::int32_t other = order.first_slot[v];
        rank += other > key || (other == key && v < u);
      }
      ranks[i] = rank;
    }
    ptx::named_barrier_sync<kThreads>(sm90::kPrepareWalkBarrier);
#pragma unroll
    for (int i = 0; i < kUsersPerThread; ++i) {
      const int u = thread + i * kThreads;
      if (u >= users) break;
      order.user[ranks[i]] = u;
      const std::int64_t rows =
          std::int64_t{params.user_offsets[u + 1] - params.user_offsets[u]} * params.n_seed;
      order.first_slot[ranks[i] + 1] =
          static_cast<std::int32_t>((rows + kTileRows - 1) / kTileRows);
    }
    ptx::named_barrier_sync<kThreads>(sm90::kPrepareWalkBarrier);
    if (thread < 32) {
      // Inclusive scan of first_slot[1 .. users], 32 entries a pass.
      std::int32_t carry = 0;
      for (int base = 1; base <= users; base += 32) {
        const int r = base + thread;
        std::int32_t value = r <= users ? order.first_slot[r] : 0;
#pragma unroll
        for (int offset = 1; offset < 32; offset *= 2) {
          const std::int32_t lower = __shfl_up_sync(kFullWarp, value, offset);
          if (thread >= offset) value += lower;
        }
        if (r <= users) order.first_slot[r] = carry + value;
        carry += __shfl_sync(kFullWarp, value, 31);
      }
      if (thread == 0) order.first_slot[0] = 0;
    }
  }

  // The unit the walk's `index` stands for (snake rounds).
  __device__ static int snake_unit(const Params& params, int index) {
    const int grid = static_cast<int>(gridDim.x);
    const int round = index / grid;
    if (round % 2 == 0 || (round + 1) * grid > params.num_units) return index;
    return round * grid + (grid - 1 - index % grid);
  }

  __device__ static UnitInfo describe(const Params& params, const SharedStorage& shared,
                                      int index)
    requires kLengthOrder
  {
    const WalkOrder& order = shared.walk_order;
    const int unit = snake_unit(params, index);
    const std::int64_t slot = unit / params.heads;
    const int rank = last_at_most(params.num_users, slot,
                                  [&](int r) -> std::int64_t { return order.first_slot[r]; });
    return describe_slot(params, unit % params.heads, order.user[rank],
                         slot - order.first_slot[rank]);
  }

  __device__ static UnitInfo describe(const Params& params, int unit)
    requires(!kLengthOrder)
  {
    if constexpr (kSplitKeys) {
      UnitInfo info = describe_tile(params, unit / params.splits);
      keep_key_range(params, info, unit % params.splits);
      return info;
    } else {
      return describe_tile(params, unit);
    }
  }

  // The query tile `tile` (slot * H + head) with all of its user's keys.
  __device__ static UnitInfo describe_tile(const Params& params, int tile) {
    const std::int64_t slot = tile / params.heads;
    const int user = last_at_most(params.num_users, slot,
                                  [&](int u) { return first_slot(params, u); });
    return describe_slot(params, tile % params.heads, user, slot - first_slot(params, user));
  }

  // Split keys: narrows a tile's unit to its key range `range` of
  // params.splits, blocks [range * n / splits, (range + 1) * n / splits) of
  // its n, as if they were all of its user's keys (an empty range: a unit
  // without keys).
  __device__ static void keep_key_range(const Params& params, UnitInfo& info, int range) {
    if (info.blocks == 0) return;
    const int first = range * info.blocks / params.splits;
    const int last = (range + 1) * info.blocks / params.splits;
    const int first_key = first * kBlockN;
    info.kv_row += first_key;
    info.kv_length = std::max(std::min(info.kv_length, last * kBlockN) - first_key, 0);
    info.blocks = last - first;
  }

  // The last index i < n with first(i) <= slot (first never decreases,
  // first(0) = 0 <= slot).
  template <class First>
  __device__ __forceinline__ static int last_at_most(int n, std::int64_t slot, First&& first) {
    int low = 0, high = n;
    while (high - low > 1) {
      const int middle = (low + high) / 2;
      if (first(middle) <= slot) {
        low = middle;
      } else {
        high = middle;
      }
    }
    return low;
  }

  // Tile `tile` of `user`'s query rows, head `head`.
  __device__ static UnitInfo describe_slot(const Params& params, int head, int user,
                                           std::int64_t tile) {
    UnitInfo info;
    info.head = head;
    info.user = user;
    info.first_row = static_cast<int>(tile * kTileRows);
    info.group_begin = params.user_offsets[user];
    const std::int64_t user_rows =
        std::int64_t{params.user_offsets[user + 1] - info.group_begin} * params.n_seed;
    info.rows = static_cast<int>(
        std::min<std::int64_t>(std::max<std::int64_t>(user_rows - info.first_row, 0), kTileRows));
    if (params.kv_offsets != nullptr) {
      info.kv_row = params.kv_offsets[user];
      info.kv_length = params.kv_offsets[user + 1] - params.kv_offsets[user];
    } else {
      info.kv_length = params.dense_seq_len;
    }
    info.blocks = info.rows > 0 ? (info.kv_length + kBlockN - 1) / kBlockN : 0;
    return info;
  }

  // The row of q / out, as [B * n_seed * H][D], of row `row` of the unit's
  // tile (row < info.rows).
  __device__ static std::int64_t query_row(const Params& params, const UnitInfo& info, int row) {
    const std::int64_t user_row = std::int64_t{info.first_row} + row;
    const std::int64_t candidate =
        params.candidates_by_user[info.group_begin + user_row / params.n_seed];
    return (candidate * params.n_seed + user_row % params.n_seed) * params.heads + info.head;
  }

  __device__ static int num_units(const Params& params) { return params.num_units; }

  // The k-steps of a unit's n blocks, in ring order: K_0, V_0, K_1, V_1,
  // ..., or with kKeysAhead K_0, K_1, V_0, K_2, V_1, ..., K_{n-1}, V_{n-2},
  // V_{n-1}. Block j's issue needs K_j, then V_{j-1}, and releases both. In
  // a ring of 3 stages (D = 256) the first order holds V_{j-1}, K_j and V_j
  // then, so K_{j+1} starts loading only after block j's release and the
  // consumers wait for it; with K_j a block ahead, the ring holds K_j,
  // V_{j-1} and K_{j+1}, and the V_j loading after the release is needed
  // only once QK_{j+1}^T has been issued (H100, D = 256: +18-27% at S = 512
  // ... 8192). With 4 stages or more both orders have block j + 1's loads
  // in flight during block j, and the first measured 0.5-2% faster (D = 128).
  static constexpr bool kKeysAhead = kStages < 4;
  __device__ static int num_k_steps(const Params&, const UnitInfo& info) { return 2 * info.blocks; }
  __device__ static int key_step(int block) {
    if constexpr (kKeysAhead) return block == 0 ? 0 : 2 * block - 1;
    return 2 * block;
  }
  __device__ static int value_step(int block, int blocks) {
    if constexpr (kKeysAhead) return min(2 * block + 2, 2 * blocks - 1);
    return 2 * block + 1;
  }

  // ---- producer ----

  // Every k-step fills its whole stage (keys past the end arrive as zeros).
  __device__ static std::uint32_t stage_bytes(const Params&, const UnitInfo&, int) {
    return sizeof(Stage);
  }

  __device__ static void load(const Params& params, const UnitInfo& info, int, int k_step,
                              Stage& stage, std::uint64_t* full) {
    // The block and operand of k_step (see key_step and value_step).
    bool value = (k_step & 1) != 0;
    int kv_block = k_step >> 1;
    if constexpr (kKeysAhead) {
      const int last = 2 * info.blocks - 1;
      value = k_step == last || (k_step > 0 && !value);
      kv_block = k_step == last ? info.blocks - 1 : value ? k_step / 2 - 1 : (k_step + 1) / 2;
    }
    const CUtensorMap* map = value ? &params.values : &params.keys;
    const int first_key = block_first_key(params, info, kv_block);
#pragma unroll
    for (int block = 0; block < kColumnBlocks; ++block) {
      if (params.kv_offsets != nullptr) {
        ptx::tma_load(stage.tile[block], map, block * kSwizzleElements, info.head,
                      static_cast<std::int32_t>(info.kv_row + first_key), full);
      } else {
        ptx::tma_load(stage.tile[block], map, block * kSwizzleElements, info.head,
                      (kSplitKeys ? info.kv_row : 0) + first_key, info.user, full);
      }
    }
  }

  // Warps 1 .. kUnitLoaderWarps of the producer (loader 0 .. 64 *
  // kUnitLoaderWarps - 1): warp w gathers rows 64w .. 64w + 63 of the tile.
  // Each lane finds the rows of q that two tile rows are (before the slot
  // is free: a dependent load of the candidate map); the warp then copies
  // kChunksPerRow / 32-row passes, lane l moving chunk l % kChunksPerRow of
  // a row, so each cp.async instruction reads whole contiguous rows.
  static_assert(kUnitLoaderWarps * kWarpgroupRows == kTileRows);
  struct UnitRows {
    std::int32_t low, high;  // row_heads of tile rows 64w + l and 64w + 32 + l
  };

  __device__ static UnitRows prepare_unit(const Params& params, const UnitInfo& info,
                                          int loader) {
    const int first = loader / 32 * kWarpgroupRows + loader % 32;
    const auto row_head = [&](int row) -> std::int32_t {
      return row < info.rows ? static_cast<std::int32_t>(query_row(params, info, row)) : -1;
    };
    return {row_head(first), row_head(first + 32)};
  }

  __device__ static void load_unit(const Params& params, const UnitInfo& info, int,
                                   const UnitRows& rows, SharedStorage& shared, int slot,
                                   int loader) {
    const int warp = loader / 32, lane = loader % 32;
    UnitMeta& meta = shared.unit_meta[slot];
    if (loader == 0) meta.info = info;
    const int first = warp * kWarpgroupRows;
    const auto* q = static_cast<const Element*>(params.q);
    meta.row_heads[first + lane] = rows.low;
    meta.row_heads[first + 32 + lane] = rows.high;

    constexpr int kRowsPerPass = 32 / kChunksPerRow;
    const int chunk = lane % kChunksPerRow;
    const std::uint32_t tile = ptx::shared_address(shared.q_tiles[slot].q[0]);
#pragma unroll 4
    for (int pass = 0; pass < kWarpgroupRows / kRowsPerPass; ++pass) {
      const int local = pass * kRowsPerPass + lane / kChunksPerRow;
      // Every lane of a pass reads from the same half (rows below or above 32).
      const std::int32_t row =
          __shfl_sync(kFullWarp, local < 32 ? rows.low : rows.high, local % 32);
      const bool valid = row >= 0;
      ptx::cp_async_16(tile + tile_offset<kTileRows>(first + local, chunk),
                       valid ? q + std::int64_t{row} * kHeadDim + chunk * 8 : q, valid);
    }
    ptx::cp_async_commit();
    ptx::cp_async_wait<0>();
    ptx::fence_async_shared();
  }

  // ---- consumers ----

  __device__ __forceinline__ static void turn_begin(int consumer) {
    if constexpr (kPingPong) ptx::named_barrier_sync<kConsumerThreads>(kTurnBarrier + consumer);
  }

  __device__ __forceinline__ static void turn_end(int consumer) {
    if constexpr (kPingPong) {
      ptx::named_barrier_arrive<kConsumerThreads>(kTurnBarrier + (consumer ^ 1));
    }
  }

  __device__ static void drain(SharedStorage&, int consumer) {
    if (consumer == 0) turn_begin(consumer);  // the turn consumer 1 handed back last
  }

  // Registers of one consumer thread that live across units.
  struct ConsumerRegisters {
    float scores[kScoreRegisters];            // S of the current block
    std::uint32_t p_fragments[kPvSlices][4];  // P rounded, the A operand of PV
    float out_acc[kOutRegisters];
    float row_max[2];  // log2 domain, scaled
    float row_sum[2];  // this thread's columns only until the epilogue
  };

  // One block's online softmax on this thread's scores: rows
  // 16 * warp + lane / 4 (half 0) and + 8 (half 1), columns
  // 8 * group + 2 * (lane % 4) + {0, 1} of register 4 * group + {0, 1}
  // (half 0) and + {2, 3} (half 1). Writes P = exp2(scale_log2 * score -
  // row_max), rounded, into p_fragments (the A operand of the next PV; the
  // previous one must have retired), keeps the scores, sets the factor by
  // which earlier results must be rescaled and returns whether any row of
  // the warp has one other than 1. kMasked: only the valid_keys keys from
  // first_valid on count (the others get P = 0). kFirst: the unit's first
  // block (no running maximum yet). kColumns: the scores of a block kColumns
  // keys wide (a half-width last block fills the first kColumns / 16
  // slices of P). kKnownRescale: the caller has found that the block fails
  // the lazy-rescaling check; straight to the maxima.
  //
  // Lazy rescaling: a warp keeps its rows' running maxima while a block's P,
  // computed from them, sums to at most kRescaleLimit over each thread's
  // part of each row. P then stays at most kRescaleLimit (exact range in
  // fp16 and bf16, and the same relative rounding), and the block needs no
  // rescaling of O. The check rides on the row sums the softmax needs
  // anyway, so neither the row maxima (a reduction across the quad) nor any
  // other pass over the scores is on the softmax's critical path; a block
  // that fails it (and the first, whose correction exp2(-inf) is 0)
  // computes the maxima and its P again.
  //
  // The first block: with `predicted`, row_max holds the maxima of the
  // rows of an earlier unit, tried as the reference first (kPredictFloor);
  // then the return value says whether the guess missed.
  template <bool kMasked, bool kFirst, int kColumns = kBlockN, bool kKnownRescale = false>
  __device__ __forceinline__ static bool online_softmax(ConsumerRegisters& registers,
                                                        float (&correction)[2], float scale_log2,
                                                        int first_valid, int valid_keys,
                                                        bool predicted = false) {
    // This thread's first column, relative to the first valid key.
    const int column = 2 * (static_cast<int>(threadIdx.x) % 4) - first_valid;
    const auto valid = [&](int index) {
      return !kMasked || static_cast<unsigned>(column + 8 * (index / 4) + (index % 2)) <
                             static_cast<unsigned>(valid_keys);
    };
    float block_sum[2];
    // P and its sums from the maxima in row_max.
    const auto exponentiate = [&] {
      block_sum[0] = block_sum[1] = 0.0f;
#pragma unroll
      for (int slice = 0; slice < kColumns / kWgmmaK; ++slice) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int half = i % 2, index = 8 * slice + 2 * i;
          float p[2];
#pragma unroll
          for (int k = 0; k < 2; ++k) {
            const float exponent =
                valid(index + k)
                    ? fmaf(registers.scores[index + k], scale_log2, -registers.row_max[half])
                    : -INFINITY;
            p[k] = ptx::exp2_approx(exponent);  // exp2(-inf) = 0
            block_sum[half] += p[k];
          }
          registers.p_fragments[slice][i] = ptx::pack_pair<Element>(p[0], p[1]);
        }
      }
    };
    if constexpr (kFirst) {
      if (predicted) {
        exponentiate();
        // A NaN sum (fminf / fmaxf drop it) comes only from NaN scores, whose
        // row ends NaN either way; the maxima are never NaN.
        if (!__any_sync(kFullWarp, fmaxf(block_sum[0], block_sum[1]) > kRescaleLimit ||
                                       fminf(block_sum[0], block_sum[1]) < kPredictFloor)) {
          registers.row_sum[0] = block_sum[0];
          registers.row_sum[1] = block_sum[1];
          return false;
        }
      }
      registers.row_max[0] = registers.row_max[1] = -INFINITY;
    } else if constexpr (!kKnownRescale) {
      exponentiate();
      if (!fails_lazy_check(block_sum)) {
        correction[0] = correction[1] = 1.0f;
#pragma unroll
        for (int half = 0; half < 2; ++half) registers.row_sum[half] += block_sum[half];
        return false;
      }
    }
    // The rows' maxima over the quad's valid scores: max(scale * s) is
    // scale * max(s) for scale >= 0, scale * min(s) otherwise.
    float extreme[2];
    const auto reduce = [&](auto pick, float start) {
      // Four chains per row half: the first block's maxima are on the critical path.
      float chains[2][4];
#pragma unroll
      for (int chain = 0; chain < 4; ++chain) chains[0][chain] = chains[1][chain] = start;
#pragma unroll
      for (int i = 0; i < kColumns / 2; ++i) {
        float& chain = chains[(i / 2) % 2][(i / 4) % 4];
        if (valid(i)) chain = pick(chain, registers.scores[i]);
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        extreme[half] = pick(pick(chains[half][0], chains[half][1]),
                             pick(chains[half][2], chains[half][3]));
        extreme[half] = pick(extreme[half], __shfl_xor_sync(kFullWarp, extreme[half], 1));
        extreme[half] = pick(extreme[half], __shfl_xor_sync(kFullWarp, extreme[half], 2));
      }
    };
    if (scale_log2 >= 0.0f) {
      reduce([](float a, float b) { return fmaxf(a, b); }, -INFINITY);
    } else {
      reduce([](float a, float b) { return fminf(a, b); }, INFINITY);
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float new_max = running_max(registers.row_max[half], extreme[half] * scale_log2);
      correction[half] = ptx::exp2_approx(registers.row_max[half] - new_max);
      registers.row_max[half] = new_max;
    }
    exponentiate();
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      registers.row_sum[half] = registers.row_sum[half] * correction[half] + block_sum[half];
    }
    return true;
  }

  // Whether a block's P from the running maxima, whose sums over this
  // thread's part of its rows are block_sum, fails the lazy-rescaling check
  // in any row of the warp.
  __device__ __forceinline__ static bool fails_lazy_check(const float (&block_sum)[2]) {
    return __any_sync(kFullWarp, fmaxf(block_sum[0], block_sum[1]) > kRescaleLimit);
  }

  // kExpsUnderPv: a block's P from the running maxima (the same
  // instructions as online_softmax's), in fp32 in place of its scores, and
  // this thread's sums of it per row half; pack_scores rounds it into
  // p_fragments once the previous PV has retired.
  __device__ __forceinline__ static void exponentiate_scores(ConsumerRegisters& registers,
                                                             float scale_log2,
                                                             float (&block_sum)[2]) {
    block_sum[0] = block_sum[1] = 0.0f;
#pragma unroll
    for (int index = 0; index < kScoreRegisters; ++index) {
      const int half = (index / 2) % 2;
      registers.scores[index] = ptx::exp2_approx(
          fmaf(registers.scores[index], scale_log2, -registers.row_max[half]));
      block_sum[half] += registers.scores[index];
    }
  }

  // kExpsUnderPv: this warp's 16 rows of S = Q K^T for the K block in
  // `k_stage`, by mma.sync m16n8k16 from the swizzled tiles (its C fragment
  // is the wgmma accumulator's layout for the warp's rows).
  __device__ __forceinline__ static void recompute_scores(ConsumerRegisters& registers,
                                                          const SharedStorage& shared, int slot,
                                                          int consumer, int k_stage) {
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const int warp = (static_cast<int>(threadIdx.x) / 32) % 4;
    const std::uint32_t q_tile = ptx::shared_address(shared.q_tiles[slot].q[0]);
    const std::uint32_t k_tile = ptx::shared_address(shared.stages[k_stage].tile[0]);
    const int matrix = lane / 8;
    const int q_row = consumer * kWarpgroupRows + warp * 16 + (matrix % 2) * 8 + lane % 8;
    const int key = (matrix / 2) * 8 + lane % 8;
#pragma unroll
    for (int i = 0; i < kScoreRegisters; ++i) registers.scores[i] = 0.0f;
#pragma unroll 1
    for (int step = 0; step < kHeadDim / kWgmmaK; ++step) {
      std::uint32_t a[4];
      ptx::ldmatrix_x4(a, q_tile + tile_offset<kTileRows>(q_row, 2 * step + matrix / 2));
      // Keys 16 * pair + key share their row % 8, hence their swizzled chunk.
      const std::uint32_t keys = k_tile + tile_offset<kBlockN>(key, 2 * step + matrix % 2);
#pragma unroll
      for (int pair = 0; pair < kBlockN / 16; ++pair) {
        std::uint32_t b[4];
        ptx::ldmatrix_x4(b, keys + pair * 16 * kSwizzleRowBytes);
        auto& low = *reinterpret_cast<float(*)[4]>(registers.scores + 8 * pair);
        auto& high = *reinterpret_cast<float(*)[4]>(registers.scores + 8 * pair + 4);
        ptx::mma_m16n8k16<Element>(low, a, b[0], b[1]);
        ptx::mma_m16n8k16<Element>(high, a, b[2], b[3]);
      }
    }
  }

  __device__ __forceinline__ static void pack_scores(ConsumerRegisters& registers) {
#pragma unroll
    for (int slice = 0; slice < kPvSlices; ++slice) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int index = 8 * slice + 2 * i;
        registers.p_fragments[slice][i] =
            ptx::pack_pair<Element>(registers.scores[index], registers.scores[index + 1]);
      }
    }
  }

  // The operand descriptors of a unit: this warpgroup's 64 rows of Q, and
  // stage 0's K (K-major) and V (MN-major: d contiguous, its 64-wide d
  // blocks kBlockN rows apart); stage s's are sizeof(Stage) * s further on.
  struct Descriptors {
    std::uint64_t q, k, v;
    __device__ __forceinline__ Descriptors(const SharedStorage& shared, int slot, int consumer)
        : q(ptx::wgmma_descriptor_sw128(
              shared.q_tiles[slot].q[0] + consumer * kWarpgroupRows * kSwizzleElements, 16,
              kAtomBytes)),
          k(ptx::wgmma_descriptor_sw128(shared.stages[0].tile[0], 16, kAtomBytes)),
          v(ptx::wgmma_descriptor_sw128(shared.stages[0].tile[0], kBlockN * kSwizzleRowBytes,
                                        kAtomBytes)) {}
    __device__ __forceinline__ std::uint64_t k_at(int stage) const {
      return ptx::advance_descriptor(k, static_cast<std::uint32_t>(stage * sizeof(Stage)));
    }
    __device__ __forceinline__ std::uint64_t v_at(int stage) const {
      return ptx::advance_descriptor(v, static_cast<std::uint32_t>(stage * sizeof(Stage)));
    }
  };

  // S = Q K^T for this warpgroup's 64 rows and the K block of `k_stage`,
  // committed as one group. Q and K are K-major. kColumns < kBlockN: the
  // keys first_key .. first_key + kColumns - 1 of the block only (a
  // multiple of the 8-row swizzle atom), into the first scores.
  template <int kColumns = kBlockN>
  __device__ __forceinline__ static void issue_scores(ConsumerRegisters& registers,
                                                      const Descriptors& descriptors, int k_stage,
                                                      int first_key = 0) {
    const std::uint64_t q_descriptor = descriptors.q;
    const std::uint64_t k_descriptor = ptx::advance_descriptor(
        descriptors.k_at(k_stage), static_cast<std::uint32_t>(first_key * kSwizzleRowBytes));
    auto& scores = *reinterpret_cast<float(*)[kColumns / 2]>(registers.scores);
#pragma unroll
    for (int slice = 0; slice < kQkSlices; ++slice) {
      ptx::wgmma_ss<Element, 0, 0, kColumns>(
          scores, ptx::advance_descriptor(q_descriptor, k_slice_offset<kTileRows>(slice)),
          ptx::advance_descriptor(k_descriptor, k_slice_offset<kBlockN>(slice)), slice > 0);
    }
    ptx::wgmma_commit_group();
  }

  // O += P V for the V block of `v_stage`, committed as one group: per
  // k16 slice, one product per kPvColumns columns of O (their registers
  // follow each other in out_acc, their V column blocks too). kColumns <
  // kBlockN: P's first kColumns / 16 slices against the block's keys
  // first_key .. first_key + kColumns - 1.
  template <int kColumns = kBlockN>
  __device__ __forceinline__ static void issue_pv(ConsumerRegisters& registers,
                                                  const Descriptors& descriptors, int v_stage,
                                                  bool accumulate, int first_key = 0) {
    const std::uint64_t v_descriptor = ptx::advance_descriptor(
        descriptors.v_at(v_stage), static_cast<std::uint32_t>(first_key * kSwizzleRowBytes));
    constexpr int kParts = kHeadDim / kPvColumns;
    constexpr std::uint32_t kPartBytes = kPvColumns / kSwizzleElements * kBlockN * kSwizzleRowBytes;
#pragma unroll
    for (int slice = 0; slice < kColumns / kWgmmaK; ++slice) {
#pragma unroll
      for (int part = 0; part < kParts; ++part) {
        auto& out_part =
            *reinterpret_cast<float(*)[kPvColumns / 2]>(registers.out_acc + part * kPvColumns / 2);
        ptx::wgmma_rs<Element, 1, kPvColumns>(
            out_part, registers.p_fragments[slice],
            ptx::advance_descriptor(v_descriptor,
                                    slice * kWgmmaK * kSwizzleRowBytes + part * kPartBytes),
            accumulate || slice > 0);
      }
    }
    ptx::wgmma_commit_group();
  }

  __device__ __forceinline__ static void fence_pv_operands(ConsumerRegisters& registers) {
    ptx::fence_operands(registers.out_acc);
#pragma unroll
    for (int slice = 0; slice < kPvSlices; ++slice) {
      ptx::fence_operands(registers.p_fragments[slice]);
    }
  }

  // The units of this CTA, in order, for one consumer warpgroup.
  //
  // kLookahead defers each unit's epilogue into the next unit: it runs
  // right after that unit's first QK^T has been issued, so the tensor
  // cores work through it. Only ordinary reads of the finished O happen
  // while the product is in flight: an ordinary instruction that defined
  // wgmma accumulator registers there (a zeroed O, or the register copies
  // a conditionally issued wgmma leaves at a branch merge) would make
  // ptxas serialize every wgmma of the kernel. Hence O is started by each
  // unit's first PV product (scale-d = 0) rather than zeroed.
  template <class Walk, class Slots, class Steps>
  __device__ __forceinline__ static void consume(const Params& params, int, const Walk& walk,
                                                 Slots& slots, Steps& steps, SharedStorage& shared,
                                                 int consumer) {
    if (consumer == 1) turn_end(consumer);  // consumer 0 takes the first turn
    ConsumerRegisters registers;
#pragma unroll
    for (int i = 0; i < kScoreRegisters; ++i) registers.scores[i] = 0.0f;
#pragma unroll
    for (int i = 0; i < kOutRegisters; ++i) registers.out_acc[i] = 0.0f;
    // The epilogue owed for the previous unit (kLookahead).
    bool owed = false;
    int owed_slot = 0;
    float owed_row_sum[2] = {0.0f, 0.0f};
    // The owed O, copied out of the wgmma accumulators by real moves: ptxas
    // cannot tell that the product which wrote out_acc retired before the
    // next unit's first one was committed, and would wait for that one
    // before reading out_acc.
    float owed_out[kLookahead ? kOutRegisters : 1];
    // Dense K/V: the head of the last unit with keys, whose rows'
    // maxima (in registers.row_max) may predict the next unit's, and how many
    // units are left before guessing again after a miss. (Jagged K/V never
    // guesses: the length-ordered kernel has no registers to spare for it
    // (ptxas would serialize its wgmmas), and every schedule must give the
    // same bits.)
    int predicted_head = -1, backoff = 0;
    const auto settle = [&] {
      if (!owed) return;
      epilogue(params, shared, owed_slot, consumer, owed_out, owed_row_sum, false);
      slots.release();
      owed = false;
    };
    for (int unit = walk.first; unit < walk.count; unit += walk.step) {
      // Every unit has a slot, and its description comes with it: the
      // loaders described the unit anyway, and the consumers' own binary
      // search (dependent global loads) took ~1400 cycles at each unit
      // boundary (H100, S = 512), on the critical path.
      const int slot = slots.acquire();
      const UnitInfo info = shared.unit_meta[slot].info;
      if (info.blocks > 0) {
        const bool predicted =
            params.kv_offsets == nullptr && info.head == predicted_head && backoff == 0;
        bool missed = false;
        main_loop(params, info, steps, shared, slot, consumer, registers, settle, predicted,
                  missed);
        predicted_head = info.head;
        backoff = missed ? kPredictBackoff : std::max(backoff - 1, 0);
        if constexpr (kLookahead) {
#pragma unroll
          for (int i = 0; i < kOutRegisters; ++i) {
            asm volatile("mov.b32 %0, %1;\n" : "=f"(owed_out[i]) : "f"(registers.out_acc[i]));
          }
          owed = true;
          owed_slot = slot;
          owed_row_sum[0] = registers.row_sum[0];
          owed_row_sum[1] = registers.row_sum[1];
        } else {
          finish_unit(params, shared, slot, unit, consumer, registers, false);
          slots.release();
        }
      } else {
        // No keys (O = 0), or no query rows (an empty unit: nothing to store).
        settle();  // slots are released in order
        if (info.rows > 0) finish_unit(params, shared, slot, unit, consumer, registers, true);
        slots.release();
      }
      steps.advance(num_k_steps(params, info));
    }
    settle();
  }

  // One unit with at least one K/V block; on return every product of the
  // unit has retired and registers.out_acc / row_sum / row_max hold its O,
  // row sums and maxima. `after_first_issue` runs while the first QK^T is
  // in flight. `predicted`: row_max holds an earlier unit's maxima to try
  // as the first block's reference; `missed` is set when that guess failed.
  template <class Steps, class AfterFirstIssue>
  __device__ __forceinline__ static void main_loop(const Params& params, const UnitInfo& info,
                                                   Steps& steps, SharedStorage& shared, int slot,
                                                   int consumer, ConsumerRegisters& registers,
                                                   AfterFirstIssue&& after_first_issue,
                                                   bool predicted, bool& missed) {
    const int blocks = info.blocks;
    const int tail_keys = last_block_keys(info);
    // The last block's new keys: its first tail_keys, or its last ones when
    // it ends at the user's last key.
    const int tail_first = end_aligned_last_block(params, info) ? kBlockN - tail_keys : 0;
    const float scale_log2 = params.scale_log2;
    const Descriptors descriptors(shared, slot, consumer);
    float correction[2];
    // Block 0's softmax, masked when block 0 is also the last and the
    // user's keys end inside it.
    const auto first_softmax = [&] {
      if constexpr (!kWholeBlocks) {
        if (blocks == 1 && tail_keys < kBlockN) {
          online_softmax<true, true>(registers, correction, scale_log2, tail_first, tail_keys);
          return;
        }
      }
      missed = online_softmax<false, true>(registers, correction, scale_log2, 0, kBlockN,
                                           predicted) &&
               predicted;
    };

    // Block 0: S = Q K_0^T, softmax.
    {
      const int k_stage = steps.wait(0);
      turn_begin(consumer);
      ptx::fence_operands(registers.scores);
      ptx::wgmma_fence();
      issue_scores(registers, descriptors, k_stage);
      turn_end(consumer);
      after_first_issue();
      registers.row_sum[0] = registers.row_sum[1] = 0.0f;
      ptx::wgmma_wait<0>();
      ptx::fence_operands(registers.scores);
      steps.release(k_stage);
      first_softmax();
    }
    // Block j: S = Q K_j^T and O += P_{j-1} V_{j-1} issued together. The
    // tensor pipe accepts a warpgroup's wgmmas about as fast as it runs them,
    // so both have (nearly) retired when the issue returns: the softmax
    // overlaps the other warpgroup's products, and writes P_j in place of
    // P_{j-1}.
    // A last block narrower than kBlockN (its new keys fit in kColumns of
    // them) covers the block's first kColumns keys, or its last ones when
    // the block ends at the user's last key: where it starts in the stage.
    const auto first_key_of = [&](auto columns) {
      constexpr int kColumns = decltype(columns)::value;
      return kColumns < kBlockN && tail_first > 0 ? kBlockN - kColumns : 0;
    };
    const auto next_block = [&](int block, auto masked, auto columns) {
      constexpr int kColumns = decltype(columns)::value;
      const int first_key = first_key_of(columns);
      const int k_stage = steps.wait(key_step(block));
      turn_begin(consumer);
      ptx::fence_operands(registers.scores);
      ptx::fence_operands(registers.out_acc);
      ptx::wgmma_fence();
      issue_scores<kColumns>(registers, descriptors, k_stage, first_key);
      // V_{j-1} is awaited only now: its load may still be landing while QK_j^T runs.
      const int v_stage = steps.wait(value_step(block - 1, blocks));
      issue_pv(registers, descriptors, v_stage, block > 1);  // PV_0 starts O
      turn_end(consumer);
      bool rescale;
      if constexpr (kExpsUnderPv && kColumns == kBlockN &&
                    std::is_same_v<decltype(masked), std::false_type>) {
        ptx::wgmma_wait<1>();  // S_j; PV_{j-1} may still run
        ptx::fence_operands(registers.scores);
        float block_sum[2];
        exponentiate_scores(registers, scale_log2, block_sum);
        const bool fails = fails_lazy_check(block_sum);
        ptx::wgmma_wait<0>();
        ptx::fence_operands(registers.scores);
        fence_pv_operands(registers);
        steps.release(v_stage);
        if (!fails) {
          steps.release(k_stage);
          pack_scores(registers);
#pragma unroll
          for (int half = 0; half < 2; ++half) registers.row_sum[half] += block_sum[half];
          return;
        }
        // The warp's scores again (mma.sync: the decision is the warp's, and a
        // wgmma takes the whole warpgroup), then the exact path.
        recompute_scores(registers, shared, slot, consumer, k_stage);
        steps.release_read(k_stage);
        rescale = online_softmax<false, false, kColumns, true>(registers, correction,
                                                               scale_log2, 0, kBlockN);
      } else {
        ptx::wgmma_wait<0>();
        ptx::fence_operands(registers.scores);
        fence_pv_operands(registers);
        steps.release(k_stage);
        steps.release(v_stage);
        const auto softmax = [&](auto masked_softmax) {
          constexpr bool kMasked = decltype(masked_softmax)::value;
          return online_softmax<kMasked, false, kColumns>(registers, correction, scale_log2,
                                                          kMasked ? tail_first - first_key : 0,
                                                          kMasked ? tail_keys : kBlockN);
        };
        if constexpr (std::is_same_v<decltype(masked), MaskWhereKeysEnd>) {
          rescale = block == blocks - 1 && tail_keys < kBlockN ? softmax(std::true_type{})
                                                                : softmax(std::false_type{});
        } else {
          rescale = softmax(masked);
        }
      }
      if (rescale) {
#pragma unroll
        for (int i = 0; i < kOutRegisters; ++i) registers.out_acc[i] *= correction[(i / 2) % 2];
      }
    };
    // O += P_{n-1} V_{n-1}.
    const auto last_pv = [&](auto columns) {
      constexpr int kColumns = decltype(columns)::value;
      const int first_key = first_key_of(columns);
      const int last_step = value_step(blocks - 1, blocks);
      const int v_stage = steps.wait(last_step);
      if constexpr (kFixUpWarp) {
        if (fix_up_step(params, info, last_step)) steps.wait_fixed(v_stage);
      } else if constexpr (kTall) {
        if (fix_up_step(params, info, last_step)) {
          // The consumers' ordinary reads of the stage's earlier contents
          // (recompute_scores) come first: the copies that refilled it order
          // them, but compute-sanitizer's racecheck cannot see through those.
          ptx::named_barrier_sync<kConsumers * kWarpgroupThreads>(kFixBarrier);
          fix_up(params, info, last_step, shared.stages[v_stage],
                 consumer * kWarpgroupThreads + thread_index_here() % kWarpgroupThreads,
                 kConsumers * kWarpgroupThreads);
          ptx::fence_async_shared();  // the PV below reads the zeros through the async proxy
          ptx::named_barrier_sync<kConsumers * kWarpgroupThreads>(kFixBarrier);
        }
      }
      turn_begin(consumer);
      ptx::fence_operands(registers.out_acc);
      ptx::wgmma_fence();
      issue_pv<kColumns>(registers, descriptors, v_stage, blocks > 1, first_key);
      turn_end(consumer);
      ptx::wgmma_wait<0>();
      fence_pv_operands(registers);
      steps.release(v_stage);
    };
    using Whole = std::integral_constant<int, kBlockN>;
    if constexpr (kWholeBlocks) {
      for (int block = 1; block < blocks; ++block) next_block(block, std::false_type{}, Whole{});
    } else if constexpr (tail_out_of_loop(kHeadDim)) {
      // The last block, whose keys may end inside it, runs after the loop
      // with the masked softmax (a full last block through a window of all
      // its keys), over half the block when its new keys fit there (64
      // keys; kTall's 64-key blocks 32, an m64n32 QK^T). Each path retires
      // its products before the paths join: a wgmma still in flight across
      // the join would make ptxas serialize them all.
      for (int block = 1; block < blocks - 1; ++block) {
        next_block(block, std::false_type{}, Whole{});
      }
      if (blocks > 1 && tail_keys <= kBlockN / 2) {
        using Half = std::integral_constant<int, kBlockN / 2>;
        next_block(blocks - 1, std::true_type{}, Half{});
        last_pv(Half{});
        return;
      }
      if (blocks > 1) next_block(blocks - 1, std::true_type{}, Whole{});
    } else {
      for (int block = 1; block < blocks; ++block) next_block(block, MaskWhereKeysEnd{}, Whole{});
    }
    last_pv(Whole{});
  }

  // ---- the fixer (producer warp 3) ----

  // Jagged K/V: the rows of a user's last block past its keys are the next
  // user's. Their P is 0, but 0 * Inf is NaN, so the fixer zeros those V
  // rows (a row of a 64-wide column block is 128 contiguous bytes; the
  // swizzle only permutes its 16-byte chunks) once the block has landed,
  // and the consumers wait for it before the block's PV. Dense K/V needs
  // none of this: the tensor map zero-fills keys past S.
  __device__ static int last_block_keys(const UnitInfo& info) {
    return info.kv_length - (info.blocks - 1) * kBlockN;  // 1 .. kBlockN
  }

  // Jagged K/V of a user with at least kBlockN keys: the last block ends at
  // the user's last key instead (it starts up to kBlockN - 1 keys early,
  // over keys of the block before, which its softmax masks), so it reads
  // none of the next user's rows and needs no fix-up. Only a user with
  // fewer keys, a single block from its first key, has rows to clear.
  __device__ static bool end_aligned_last_block(const Params& params, const UnitInfo& info) {
    return params.kv_offsets != nullptr && info.kv_length >= kBlockN;
  }

  __device__ static int block_first_key(const Params& params, const UnitInfo& info, int block) {
    if (block == info.blocks - 1 && end_aligned_last_block(params, info)) {
      return info.kv_length - kBlockN;
    }
    return block * kBlockN;
  }

  __device__ static bool fix_up_step(const Params& params, const UnitInfo& info, int k_step) {
    return params.kv_offsets != nullptr && info.kv_length < kBlockN &&
           k_step == value_step(info.blocks - 1, info.blocks);
  }

  __device__ static void fix_up(const Params&, const UnitInfo& info, int, Stage& stage,
                                int lane, int lanes = 32) {
    const int keys = last_block_keys(info);
    constexpr int kChunksPerBlockRow = kSwizzleRowBytes / 16;
    const int chunks = (kBlockN - keys) * kChunksPerBlockRow;
#pragma unroll
    for (int block = 0; block < kColumnBlocks; ++block) {
      auto* rows = reinterpret_cast<uint4*>(stage.tile[block] + keys * kSwizzleElements);
      for (int chunk = lane; chunk < chunks; chunk += lanes) rows[chunk] = make_uint4(0, 0, 0, 0);
    }
  }

  // The epilogue of a unit run without the look-ahead: its output, or with
  // split keys its partial result.
  __device__ __forceinline__ static void finish_unit(const Params& params, SharedStorage& shared,
                                                     int slot, int unit, int consumer,
                                                     const ConsumerRegisters& registers,
                                                     bool no_keys) {
    if constexpr (kSplitKeys) {
      store_partial(params, shared.unit_meta[slot].info, unit, consumer, registers, no_keys);
    } else {
      epilogue(params, shared, slot, consumer, registers.out_acc, registers.row_sum, no_keys);
    }
  }

  // Split keys: this warpgroup's 64 rows of the unit's partial result, O
  // unnormalized in fp32 and each row's maximum (log2 domain, scaled; the
  // reference of O and the sum) and sum. A unit without keys stores the
  // maximum -inf and no O.
  __device__ __forceinline__ static void store_partial(const Params& params, const UnitInfo& info,
                                                       int unit, int consumer,
                                                       const ConsumerRegisters& registers,
                                                       bool no_keys) {
    const int thread = thread_index_here() % kWarpgroupThreads;
    const int warp = thread / 32, lane = thread % 32;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = consumer * kWarpgroupRows + warp * 16 + half * 8 + lane / 4;
      float sum = registers.row_sum[half];
      sum += __shfl_xor_sync(kFullWarp, sum, 1);
      sum += __shfl_xor_sync(kFullWarp, sum, 2);
      if (row >= info.rows) continue;
      if (lane % 4 == 0) {
        *split_partial_stat<kHeadDim>(params, unit, row) =
            no_keys ? make_float2(-INFINITY, 0.0f) : make_float2(registers.row_max[half], sum);
      }
      if (no_keys) continue;
      float* const partial_out = split_partial_out<kHeadDim>(params, unit, row);
#pragma unroll
      for (int group = 0; group < kHeadDim / 8; ++group) {
        *reinterpret_cast<float2*>(partial_out + 8 * group + 2 * (lane % 4)) =
            make_float2(registers.out_acc[4 * group + 2 * half],
                        registers.out_acc[4 * group + 2 * half + 1]);
      }
    }
  }

  // Normalizes, rounds and stores this warpgroup's 64 rows: stmatrix into
  // its own rows of the unit's Q slot (its QK^T products have retired; each
  // warp reads back only the 16 rows it wrote), then 16-byte chunks of the
  // rows that exist.
  __device__ __forceinline__ static void epilogue(const Params& params, SharedStorage& shared,
                                                  int slot, int consumer, const float* out_acc,
                                                  const float (&row_sum)[2], bool no_keys) {
    // The thread index is read here, not hoisted: otherwise the compiler
    // keeps every lane-dependent epilogue address live across the whole
    // unit loop and spills them.
    const int thread = thread_index_here() % kWarpgroupThreads;
    const int warp = thread / 32, lane = thread % 32;
    const int warp_rows = consumer * kWarpgroupRows + warp * 16;  // this warp's 16 tile rows
    float inverse_sum[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float sum = row_sum[half];
      sum += __shfl_xor_sync(kFullWarp, sum, 1);
      sum += __shfl_xor_sync(kFullWarp, sum, 2);
      inverse_sum[half] = sum > 0.0f ? __fdividef(1.0f, sum) : 0.0f;
    }
    // stmatrix.x4 over 8-column groups 2 * pair and 2 * pair + 1: matrix i
    // holds rows 8 * (i % 2) .. + 7 of the warp's 16 and group
    // 2 * pair + i / 2; lane l addresses row l % 8 of matrix l / 8.
    const std::uint32_t tile = ptx::shared_address(shared.q_tiles[slot].q[0]);
    const int matrix = lane / 8;
    const int lane_row = warp_rows + (matrix % 2) * 8 + lane % 8;
#pragma unroll
    for (int pair = 0; pair < kHeadDim / 16; ++pair) {
      // Register 4 * group + r belongs to row half r / 2.
      const auto pair_at = [&](int group, int half) {
        const float low = out_acc[4 * group + 2 * half], high = out_acc[4 * group + 2 * half + 1];
        return no_keys ? 0u
                       : ptx::pack_pair<Element>(low * inverse_sum[half], high * inverse_sum[half]);
      };
      ptx::stmatrix_x4(tile + tile_offset<kTileRows>(lane_row, 2 * pair + matrix / 2),
                       pair_at(2 * pair, 0), pair_at(2 * pair, 1), pair_at(2 * pair + 1, 0),
                       pair_at(2 * pair + 1, 1));
    }
    // Each warp stores the 16 rows it staged: a warp barrier, not a
    // warpgroup one. All loads first, then the stores.
    __syncwarp();
    constexpr int kRowsPerPass = 32 / kChunksPerRow;
    constexpr int kPasses = 16 / kRowsPerPass;
    const int chunk = lane % kChunksPerRow;
    const auto* staged = reinterpret_cast<const unsigned char*>(shared.q_tiles[slot].q[0]);
    const std::int32_t* slot_row_heads = shared.unit_meta[slot].row_heads;
    std::int32_t row_heads[kPasses];
    uint4 chunks[kPasses];
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int row = warp_rows + pass * kRowsPerPass + lane / kChunksPerRow;
      row_heads[pass] = slot_row_heads[row];
      chunks[pass] = *reinterpret_cast<const uint4*>(staged + tile_offset<kTileRows>(row, chunk));
    }
    auto* out = static_cast<Element*>(params.out);
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      if (row_heads[pass] >= 0) {
        *reinterpret_cast<uint4*>(out + std::int64_t{row_heads[pass]} * kHeadDim + chunk * 8) =
            chunks[pass];
      }
    }
  }
};

// Split keys: the kernel whose units are key ranges of the query tiles, at
// most kMaxKeyRanges per tile (key_ranges).
constexpr int kMaxKeyRanges = 16;

template <typename Element, int kHeadDim>
using SplitKeysKernel = AttentionSm90Kernel<Element, kHeadDim, false, false, false, false, true>;

// Split keys, after SplitKeysKernel: each query row's partial results
// combined in the order of its key ranges (so the bits repeat), normalized,
// rounded and stored, one warp per row, kCombineRows rows (of one tile) per
// block: lane r reads range r's row maximum and sum, the warp reduces them,
// then each lane combines the columns l * D / 32 onward of every range (a
// range without keys has the maximum -inf and no O).
constexpr int kCombineRows = 8;

template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(kCombineRows * 32)
    combine_split_keys(const __grid_constant__ AttentionSm90Params params) {
  static_assert(kMaxKeyRanges <= 32, "a lane per key range");
  constexpr int kColumns = kHeadDim / 32;
  constexpr int kBlocksPerTile = kBlockM / kCombineRows;
  const int tile = static_cast<int>(blockIdx.x) / kBlocksPerTile;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int row = static_cast<int>(blockIdx.x) % kBlocksPerTile * kCombineRows + warp;
  using Kernel = SplitKeysKernel<Element, kHeadDim>;
  const AttentionUnit info = Kernel::describe_tile(params, tile);
  if (row >= info.rows) return;
  const std::int64_t out_row = Kernel::query_row(params, info, row);
  const std::int64_t first_unit = std::int64_t{tile} * params.splits;
  float2 stat = make_float2(-INFINITY, 0.0f);
  if (lane < params.splits) stat = *split_partial_stat<kHeadDim>(params, first_unit + lane, row);
  float reference = stat.x;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    reference = fmaxf(reference, __shfl_xor_sync(kFullWarp, reference, offset));
  }
  // No keys in any range: zeros, as the unsplit kernel gives.
  const float weight = stat.x != -INFINITY ? exp2f(stat.x - reference) : 0.0f;
  float sum = weight * stat.y;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(kFullWarp, sum, offset);
  float values[kColumns] = {};
  for (int range = 0; range < params.splits; ++range) {
    const float range_max = __shfl_sync(kFullWarp, stat.x, range);
    const float range_weight = __shfl_sync(kFullWarp, weight, range);
    if (range_max == -INFINITY) continue;
    const float* partial =
        split_partial_out<kHeadDim>(params, first_unit + range, row) + lane * kColumns;
#pragma unroll
    for (int i = 0; i < kColumns; i += 2) {
      const float2 pair = *reinterpret_cast<const float2*>(partial + i);
      values[i] += range_weight * pair.x;
      values[i + 1] += range_weight * pair.y;
    }
  }
  const float inverse = sum > 0.0f ? 1.0f / sum : 0.0f;
  auto* destination = reinterpret_cast<std::uint32_t*>(static_cast<Element*>(params.out) +
                                                       out_row * kHeadDim + lane * kColumns);
#pragma unroll
  for (int i = 0; i < kColumns; i += 2) {
    destination[i / 2] = ptx::pack_pair<Element>(values[i] * inverse, values[i + 1] * inverse);
  }
}

// ---- device support, probed once per device ----

struct DeviceSupport {
  bool available = false;
  int multiprocessors = 0;
};

// The default schedule's kernels for the keys of a call (with_schedule).
enum class KeyWalk {
  any,                  // masked last blocks where a user's keys end inside one
  whole_blocks,         // dense K/V in whole blocks: kWholeBlocks, where D has it
  length_ordered,       // jagged K/V of few users: kLengthOrder
  tall,                 // D = 128, masked last blocks: kTall
  tall_length_ordered,  // D = 128, jagged K/V of few users: kTall and kLengthOrder
};

// Calls fn(Kernel{}) with the kernel of `schedule` (at D = 256 a
// *_lookahead schedule runs without the look-ahead, see the header comment).
// For the default schedule, `keys` picks the kWholeBlocks kernel (where D
// has one), the kLengthOrder kernel (where D has room for its table), or at
// D = 128 the kTall kernels; the other schedules, kept for comparison, take
// every call with the general kernel.
template <typename Element, int kHeadDim, typename Fn>
void with_schedule(AttentionSm90Schedule schedule, KeyWalk keys, Fn&& fn) {
  constexpr bool kLookahead = kHeadDim <= 128;
  switch (schedule) {
    case AttentionSm90Schedule::ping_pong:
      return fn(AttentionSm90Kernel<Element, kHeadDim, true, false>{});
    case AttentionSm90Schedule::cooperative:
      return fn(AttentionSm90Kernel<Element, kHeadDim, false, false>{});
    case AttentionSm90Schedule::ping_pong_lookahead:
      return fn(AttentionSm90Kernel<Element, kHeadDim, true, kLookahead>{});
    case AttentionSm90Schedule::cooperative_lookahead:
      if constexpr (kHeadDim == 128) {
        if (keys == KeyWalk::tall) {
          return fn(AttentionSm90Kernel<Element, kHeadDim, false, false, false, false, false,
                                        kTallConsumers>{});
        }
        if (keys == KeyWalk::tall_length_ordered) {
          return fn(AttentionSm90Kernel<Element, kHeadDim, false, false, true, false, false,
                                        kTallConsumers>{});
        }
      }
      if constexpr (length_order_users(kHeadDim) > 0) {
        if (keys == KeyWalk::length_ordered) {
          return fn(AttentionSm90Kernel<Element, kHeadDim, false, kLookahead, true>{});
        }
      }
      if constexpr (tail_out_of_loop(kHeadDim)) {
        if (keys == KeyWalk::whole_blocks) {
          return fn(AttentionSm90Kernel<Element, kHeadDim, false, kLookahead, false, true>{});
        }
      }
      return fn(AttentionSm90Kernel<Element, kHeadDim, false, kLookahead>{});
  }
  throw RuntimeError("attention_sm90: unknown schedule");
}

// Calls fn(Kernel{}) for every kernel of every schedule.
template <typename Element, int kHeadDim, typename Fn>
void for_each_schedule(Fn&& fn) {
  for (const AttentionSm90Schedule schedule :
       {AttentionSm90Schedule::ping_pong, AttentionSm90Schedule::cooperative,
        AttentionSm90Schedule::ping_pong_lookahead, AttentionSm90Schedule::cooperative_lookahead}) {
    with_schedule<Element, kHeadDim>(schedule, KeyWalk::any, fn);
  }
  if constexpr (tail_out_of_loop(kHeadDim)) {
    with_schedule<Element, kHeadDim>(AttentionSm90Schedule::cooperative_lookahead,
                                     KeyWalk::whole_blocks, fn);
  }
  if constexpr (length_order_users(kHeadDim) > 0) {
    with_schedule<Element, kHeadDim>(AttentionSm90Schedule::cooperative_lookahead,
                                     KeyWalk::length_ordered, fn);
  }
  if constexpr (kHeadDim == 128) {
    for (const KeyWalk keys : {KeyWalk::tall, KeyWalk::tall_length_ordered}) {
      with_schedule<Element, kHeadDim>(AttentionSm90Schedule::cooperative_lookahead, keys, fn);
    }
  }
  fn(SplitKeysKernel<Element, kHeadDim>{});
}

template <typename Fn>
void for_each_kernel(Fn&& fn) {
  for_each_schedule<__half, 64>(fn);
  for_each_schedule<__half, 128>(fn);
  for_each_schedule<__half, 256>(fn);
  for_each_schedule<__nv_bfloat16, 64>(fn);
  for_each_schedule<__nv_bfloat16, 128>(fn);
  for_each_schedule<__nv_bfloat16, 256>(fn);
}

DeviceSupport probe_device(int ordinal) {
  const sm90::HopperDevice device = sm90::query_device(ordinal);
  if (!device.sm90) return {};
  bool available = true;
  for_each_kernel([&](auto kernel_traits) {
    using Kernel = decltype(kernel_traits);
    available = available && sm90::prepare_kernel(sm90::pipeline_kernel<Kernel>,
                                                  sm90::kDynamicSharedBytes<Kernel>, device);
  });
  return {available, device.multiprocessors};
}

DeviceSupport device_support(int ordinal) {
  return sm90::probed_once<DeviceSupport, probe_device>(ordinal);
}

struct PathSwitch;  // tags this path's sm90::enabled_switch

// Split keys: the fewest K/V blocks a key range may have. H100, B = 64
// (one user), H = 2, D = 128, two ranges against none: 0.73x at S = 512
// (2 blocks a range), 1.07x at 2048 (8), 1.46x at 8192 (32), the second
// launch and the partial results' round trip costing ~6 us.
constexpr int kMinRangeBlocks = 8;

std::atomic<int>& min_range_blocks_switch() {
  static std::atomic<int> blocks{kMinRangeBlocks};
  return blocks;
}

// Tall units take 1.5 times as long as 128-row units, so a call of few of
// them loses more to its last round than they save. H100, sessions 31-32,
// H = 2, n_seed = 64, 64 candidates per user, against the two-warpgroup
// kernels, by rounds of tall units on the SMs (B = 256 ... 4096: 1.35 ...
// 21.7 rounds):
// - jagged (S = 512 ... 4096): 18-35% slower at 1.35 rounds, -5 to +7%
//   from 2 to 5.4, 2.4-5% faster at 8.1 and 1.3-5% at 10.8;
// - dense tails (S = 64 ... 1000): 1-16% slower from 4 to 8.1 rounds
//   wherever S > 100 (S = 64 and 100 gain there), 0.6-16% faster from 10.8.
constexpr int kTallMinRoundsJagged = 4;
constexpr int kTallMinRoundsDense = 10;

// The rounds asked of every call when set (tests), else -1: the rule above.
std::atomic<int>& tall_min_rounds_switch() {
  static std::atomic<int> rounds{-1};
  return rounds;
}

std::int64_t tall_min_rounds(const AttentionArgs& args) {
  const int forced = tall_min_rounds_switch().load();
  if (forced >= 0) return forced;
  return args.kv_offsets != nullptr ? kTallMinRoundsJagged : kTallMinRoundsDense;
}

std::atomic<AttentionSm90Schedule>& schedule_switch() {
  static std::atomic<AttentionSm90Schedule> schedule{[] {
    const char* value = std::getenv("IKBO_ATTENTION_SM90_SCHEDULE");
    const std::string_view name = value != nullptr ? value : "";
    if (name == "ping_pong") return AttentionSm90Schedule::ping_pong;
    if (name == "cooperative") return AttentionSm90Schedule::cooperative;
    if (name == "ping_pong_lookahead") return AttentionSm90Schedule::ping_pong_lookahead;
    return AttentionSm90Schedule::cooperative_lookahead;
  }()};
  return schedule;
}

// ---- launch ----

bool aligned_16(const void* pointer) { return reinterpret_cast<std::uintptr_t>(pointer) % 16 == 0; }

std::int64_t kv_rows(const AttentionArgs& args) {
  return args.kv_offsets != nullptr ? args.kv_offsets->offsets.back()
                                    : args.num_users * args.dense_seq_len;
}

// Units of the walk: H * (floor(B * n_seed / rows) + U) for tiles of `rows`
// query rows (kTall: 192), see the header comment.
std::int64_t unit_count(const AttentionArgs& args, int tile_rows = kBlockM) {
  return args.heads * (args.num_candidates * args.n_seed / tile_rows + args.num_users);
}

// K or V in boxes of 64 d x 1 head x `block` keys (x 1 user).
template <typename Element>
CUtensorMap kv_map(const void* base, const AttentionArgs& args, int block) {
  const auto row_bytes = static_cast<cuuint64_t>(args.head_dim * kElementBytes);
  ptx::TensorMapLayout layout;
  layout.dims[0] = static_cast<cuuint64_t>(args.head_dim);
  layout.dims[1] = static_cast<cuuint64_t>(args.heads);
  layout.strides_bytes[0] = row_bytes;
  layout.strides_bytes[1] = row_bytes * static_cast<cuuint64_t>(args.heads);
  layout.box[0] = kSwizzleElements;
  layout.box[1] = 1;
  layout.box[2] = static_cast<cuuint32_t>(block);
  if (args.kv_offsets != nullptr) {
    layout.rank = 3;
    layout.dims[2] = static_cast<cuuint64_t>(kv_rows(args));
  } else {
    layout.rank = 4;
    layout.dims[2] = static_cast<cuuint64_t>(args.dense_seq_len);
    layout.dims[3] = static_cast<cuuint64_t>(args.num_users);
    layout.strides_bytes[2] = layout.strides_bytes[1] * static_cast<cuuint64_t>(args.dense_seq_len);
    layout.box[3] = 1;
  }
  return ptx::make_tensor_map(ptx::kTensorMapType<Element>, base, layout,
                              CU_TENSOR_MAP_SWIZZLE_128B);
}

// Split keys: into how many key ranges each query tile goes (1: none). A
// call whose tiles would leave more than half of the SMs idle gives each
// tile as many ranges as keep the SMs busy, at most kMaxKeyRanges and at
// most one per min_range_blocks_switch() blocks of its longest user.
int key_ranges(const AttentionArgs& args, int multiprocessors) {
  const std::int64_t tiles = unit_count(args);
  if (tiles == 0 || 2 * tiles > multiprocessors) return 1;
  const std::int64_t longest =
      args.kv_offsets != nullptr ? args.kv_offsets->max_length : args.dense_seq_len;
  const std::int64_t blocks = (longest + block_keys(args.head_dim) - 1) / block_keys(args.head_dim);
  return static_cast<int>(std::max<std::int64_t>(
      std::min<std::int64_t>(
          {multiprocessors / tiles, blocks / min_range_blocks_switch().load(), kMaxKeyRanges}),
      1));
}

// Split keys: the workspace of `ranges` key ranges per tile (the layout at
// split_partial_out); 0 when there is one.
std::size_t split_partials_bytes(const AttentionArgs& args, int ranges) {
  if (ranges <= 1) return 0;
  const auto units = static_cast<std::size_t>(unit_count(args) * ranges);
  return units * kBlockM * static_cast<std::size_t>(args.head_dim + 2) * sizeof(float);
}

template <class Kernel>
void launch(const AttentionSm90Params& params, int multiprocessors, cudaStream_t stream) {
  const int grid = std::min(params.num_units, multiprocessors);
  sm90::pipeline_kernel<Kernel>
      <<<grid, sm90::kPipelineThreads<Kernel>, sm90::kDynamicSharedBytes<Kernel>, stream>>>(params);
  check_launch("attention_sm90 (pipeline_kernel)");
}

template <typename Element, int kHeadDim>
void launch_schedule(const AttentionSm90Params& params, AttentionSm90Schedule schedule,
                     KeyWalk keys, int multiprocessors, cudaStream_t stream) {
  with_schedule<Element, kHeadDim>(schedule, keys, [&](auto kernel_traits) {
    launch<decltype(kernel_traits)>(params, multiprocessors, stream);
  });
}

// The default schedule's walk for a call's keys (with_schedule): tall units
// where keys end inside 128-key blocks (jagged, or dense of another length)
// and the call has rounds enough of them.
KeyWalk key_walk(const AttentionArgs& args, AttentionSm90Schedule schedule, int multiprocessors) {
  if (args.kv_offsets == nullptr && args.dense_seq_len % block_keys(args.head_dim) == 0) {
    return KeyWalk::whole_blocks;
  }
  const bool ordered =
      args.kv_offsets != nullptr && args.num_users <= length_order_users(args.head_dim);
  const bool tall = schedule == AttentionSm90Schedule::cooperative_lookahead &&
                    args.head_dim == 128 &&
                    unit_count(args, kTallRows) >=
                        tall_min_rounds(args) * multiprocessors;
  if (tall) return ordered ? KeyWalk::tall_length_ordered : KeyWalk::tall;
  return ordered ? KeyWalk::length_ordered : KeyWalk::any;
}

template <typename Element>
void run_attention_sm90(const AttentionArgs& args, AttentionSm90Schedule schedule,
                        int multiprocessors) {
  const int ranges = key_ranges(args, multiprocessors);
  const bool split = ranges > 1 && args.workspace != nullptr;
  const KeyWalk keys = split ? KeyWalk::any : key_walk(args, schedule, multiprocessors);
  const bool tall = keys == KeyWalk::tall || keys == KeyWalk::tall_length_ordered;
  const CandidateMapDeviceView& map = args.map->device_view;
  AttentionSm90Params params{};
  const int block = tall ? kTallBlockN : block_keys(args.head_dim);
  params.keys = kv_map<Element>(args.k, args, block);
  params.values = kv_map<Element>(args.v, args, block);
  params.q = args.q;
  params.out = args.out;
  params.user_offsets = map.user_offsets;
  params.candidates_by_user = map.candidates_by_user;
  params.kv_offsets = args.kv_offsets != nullptr ? args.kv_offsets->device_offsets : nullptr;
  params.num_users = static_cast<int>(args.num_users);
  params.heads = static_cast<int>(args.heads);
  params.n_seed = static_cast<int>(args.n_seed);
  params.dense_seq_len = static_cast<int>(args.dense_seq_len);
  params.num_units = static_cast<int>(unit_count(args, tall ? kTallRows : kBlockM));
  params.scale_log2 = args.scale * static_cast<float>(kLog2e);
  if (params.num_units == 0) return;
  const cudaStream_t stream = to_cuda_stream(args.stream);
  if (split) {
    // attention() has checked the workspace against split_partials_bytes.
    const int tiles = params.num_units;
    params.partials = static_cast<float*>(args.workspace);
    params.splits = ranges;
    params.num_units = tiles * ranges;
    with_head_dim(args, [&](auto head_dim) {
      constexpr int kHeadDim = decltype(head_dim)::value;
      launch<SplitKeysKernel<Element, kHeadDim>>(params, multiprocessors, stream);
      combine_split_keys<Element, kHeadDim>
          <<<tiles * (kBlockM / kCombineRows), kCombineRows * 32, 0, stream>>>(params);
      check_launch("attention_sm90 (combine_split_keys)");
    });
    return;
  }
  with_head_dim(args, [&](auto head_dim) {
    constexpr int kHeadDim = decltype(head_dim)::value;
    launch_schedule<Element, kHeadDim>(params, schedule, keys, multiprocessors, stream);
  });
}

}  // namespace

bool attention_sm90_available(Device device) {
  return device.is_cuda() && device_support(device.index).available;
}

bool attention_sm90_supported(const AttentionArgs& args) {
  constexpr std::int64_t kInt32Max = std::numeric_limits<std::int32_t>::max();
  if (args.dtype != DType::f16 && args.dtype != DType::bf16) return false;
  if (args.head_dim != 64 && args.head_dim != 128 && args.head_dim != 256) return false;
  if (!aligned_16(args.q) || !aligned_16(args.k) || !aligned_16(args.v) || !aligned_16(args.out)) {
    return false;
  }
  const std::int64_t rows = kv_rows(args);
  // TMA coordinates are int32; a tensor map cannot describe an empty tensor.
  // (Blocks start up to kBlockN - 1 keys before the end of a user's keys.)
  const int block = block_keys(args.head_dim);
  if (rows <= 0 || rows > kInt32Max - block || args.num_users > kInt32Max ||
      args.n_seed > kInt32Max || args.heads > kInt32Max ||
      args.dense_seq_len > kInt32Max - block) {
    return false;
  }
  // Query rows (row_heads) and units are int32.
  if (args.num_candidates * args.n_seed * args.heads > kInt32Max || unit_count(args) > kInt32Max) {
    return false;
  }
  return attention_sm90_available(args.map->device);
}

bool attention_sm90_eligible(const AttentionArgs& args) {
  return attention_sm90_enabled() && attention_sm90_supported(args);
}

std::size_t attention_sm90_workspace_bytes(const AttentionArgs& args) {
  const int multiprocessors = device_support(args.map->device.index).multiprocessors;
  return split_partials_bytes(args, key_ranges(args, multiprocessors));
}

void attention_sm90(const AttentionArgs& args, AttentionSm90Schedule schedule) {
  DeviceGuard guard(args.map->device.index);
  const int multiprocessors = device_support(args.map->device.index).multiprocessors;
  dispatch_float_dtype(args.dtype, [&](auto element) {
    using Element = decltype(element);
    if constexpr (std::is_same_v<Element, float>) {
      throw RuntimeError("attention_sm90: no Hopper kernel for float32 (not supported)");
    } else {
      run_attention_sm90<Element>(args, schedule, multiprocessors);
    }
  });
}

bool attention_sm90_enabled() { return sm90::enabled_switch<PathSwitch>().load(); }

void set_attention_sm90_enabled(bool enabled) {
  sm90::enabled_switch<PathSwitch>().store(enabled);
}

AttentionSm90Schedule attention_sm90_schedule() { return schedule_switch().load(); }

void set_attention_sm90_schedule(AttentionSm90Schedule schedule) {
  schedule_switch().store(schedule);
}

int attention_sm90_tall_min_rounds() { return tall_min_rounds_switch().load(); }

void set_attention_sm90_tall_min_rounds(int rounds) {
  tall_min_rounds_switch().store(std::max(rounds, -1));
}

int attention_sm90_min_range_blocks() { return min_range_blocks_switch().load(); }

void set_attention_sm90_min_range_blocks(int blocks) {
  min_range_blocks_switch().store(std::max(blocks, 1));
}

}  // namespace ikbo::detail::cuda
