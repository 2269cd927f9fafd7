// PENDING: being written (cpu backend helper).
#include "backend.hpp"
#include "ikbo/error.hpp"
namespace ikbo::detail::cpu {
LcePlan::State prepare_lce_plan(DType, std::int64_t, std::int64_t, std::int64_t, const void*, const void*) { throw RuntimeError("pending"); }
void lce(const LceArgs&) { throw RuntimeError("pending"); }
void attention(const AttentionArgs&) { throw RuntimeError("pending"); }
void gather_rows(const GatherRowsArgs&) { throw RuntimeError("pending"); }
}
