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

// One thread that sleeps between its reads of the timer: the GPU waits at
// next to no power, so the runs after it start from the state the timer
// settled (a busy wait on every SM, tried in session 32, drew power before
// the series and measured the same).
__global__ void wait_kernel(long long nanoseconds) {
  const long long start = global_timer_ns();
  while (global_timer_ns() - start < nanoseconds) __nanosleep(10000);
}

}  // namespace

void enqueue_gpu_wait(cudaStream_t stream, long long nanoseconds) {
  wait_kernel<<<1, 1, 0, stream>>>(nanoseconds);
  IKBO_BENCH_CHECK(cudaGetLastError());
}

}  // namespace ikbo::bench
