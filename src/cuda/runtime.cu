// PENDING: being written (cuda backend helper).
#include "backend.hpp"
#include "ikbo/error.hpp"
namespace ikbo::detail {
namespace device {
bool built_with_cuda() { return true; }
int device_count() { return 0; }
void require(Device, const char*) { throw RuntimeError("pending"); }
std::shared_ptr<void> allocate(std::size_t, Device) { throw RuntimeError("pending"); }
void copy_to_device(void*, const void*, std::size_t, Device, Stream) { throw RuntimeError("pending"); }
void copy_to_host(void*, const void*, std::size_t, Device, Stream) { throw RuntimeError("pending"); }
}
namespace cuda {
LcePlan::State prepare_lce_plan(DType, Device, std::int64_t, std::int64_t, std::int64_t, const void*, const void*, Stream) { throw RuntimeError("pending"); }
std::size_t lce_workspace_bytes(const LcePlan::State&, std::int64_t, std::int64_t, std::int64_t) { throw RuntimeError("pending"); }
void lce(const LceArgs&) { throw RuntimeError("pending"); }
void attention(const AttentionArgs&) { throw RuntimeError("pending"); }
void gather_rows(const GatherRowsArgs&) { throw RuntimeError("pending"); }
}
}
