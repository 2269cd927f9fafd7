// gpu_wait.cu — a kernel that waits on the device (gpu_wait.hpp).
#include "gpu_wait.hpp"

#include "cuda_check.hpp"

namespace ikbo::bench {
namespace {

__device__ long long global_timer_ns() {
  long long now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}

// Every thread spins without sleeping: the SMs stay busy, so the clock the
// series starts at is the one a busy GPU runs at, not an idle one's.
__global__ void wait_kernel(long long nanoseconds) {
  const long long start = global_timer_ns();
  while (global_timer_ns() - start < nanoseconds) {
  }
}

}  // namespace

void enqueue_gpu_wait(cudaStream_t stream, long long nanoseconds, int blocks) {
  wait_kernel<<<blocks, 128, 0, stream>>>(nanoseconds);
  IKBO_BENCH_CHECK(cudaGetLastError());
}

}  // namespace ikbo::bench
