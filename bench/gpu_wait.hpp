// gpu_wait.hpp — a head start for the GPU before a series of timed runs.
//
// The timer enqueues a whole series before it reads any event, so the host
// must stay ahead of the GPU: a run whose op is not yet enqueued when the
// GPU reaches its start event times the host's enqueue as well (a small op
// then reads up to twice its time). One kernel that waits on the device
// before the series lets the host queue every run while it waits.
#pragma once

#include <cuda_runtime.h>

namespace ikbo::bench {

// Enqueues a one-thread kernel on `stream` that returns `nanoseconds` after
// it starts (the device's global timer).
void enqueue_gpu_wait(cudaStream_t stream, long long nanoseconds);

}  // namespace ikbo::bench
