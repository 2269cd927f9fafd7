// Device services and CUDA backend entry points for builds without CUDA:
// every request for a CUDA device is a clear error.
#include "api/validate.hpp"
#include "backend.hpp"

namespace ikbo::detail {
namespace {
[[noreturn]] void no_cuda(const char* what) {
  fail(what, " is on a CUDA device, but this ikbo build has no CUDA backend "
             "(rebuild with the CUDA toolkit installed)");
}
}  // namespace

namespace device {
bool built_with_cuda() { return false; }
int device_count() { return 0; }
void require(Device device, const char* what) {
  if (device.is_cuda()) no_cuda(what);
}
std::shared_ptr<void> allocate(std::size_t, Device) { no_cuda("an allocation"); }
void require_memory_on(const void*, Device, std::string_view) { no_cuda("the memory"); }
void copy_to_device(void*, const void*, std::size_t, Device, Stream) { no_cuda("a copy"); }
void copy_to_host(void*, const void*, std::size_t, Device, Stream) { no_cuda("a copy"); }
void zero(void*, std::size_t, Device, Stream) { no_cuda("a buffer to zero"); }
}  // namespace device

namespace cuda {
LcePlan::State prepare_lce_plan(DType, Device, std::int64_t, std::int64_t, std::int64_t,
                                const void*, const void*, Stream) {
  no_cuda("w_c");
}
std::size_t lce_workspace_bytes(const LcePlan::State&, std::int64_t, std::int64_t,
                                std::int64_t) {
  no_cuda("the plan");
}
void lce(const LceArgs&) { no_cuda("e_c"); }
std::size_t lce_decomposed_workspace_bytes(DType, std::int64_t, std::int64_t, std::int64_t) {
  no_cuda("e_c");
}
void lce_decomposed(const LceDecomposedArgs&) { no_cuda("e_c"); }
std::optional<std::string> lce_fused_blocker(const LceArgs&) { no_cuda("the plan"); }
void lce_fused(const LceArgs&) { no_cuda("the plan"); }
LinearPlan::State prepare_linear_plan(const LinearWeights&, Device, Stream) { no_cuda("w_u"); }
std::size_t linear_workspace_bytes(const LinearPlan::State&, std::int64_t, std::int64_t) {
  no_cuda("the plan");
}
void linear(const LinearArgs&) { no_cuda("x_c"); }
void linear_decomposed(const LinearArgs&) { no_cuda("x_c"); }
std::size_t linear_concat_workspace_bytes() { no_cuda("x_full"); }
void linear_concat(const LinearConcatArgs&) { no_cuda("x_full"); }
std::size_t attention_workspace_bytes(const AttentionArgs&) { no_cuda("q"); }
void attention(const AttentionArgs&) { no_cuda("q"); }
void gather_rows(const GatherRowsArgs&) { no_cuda("the source"); }
}  // namespace cuda

}  // namespace ikbo::detail
