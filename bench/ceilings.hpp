// ceilings.hpp — the roofline every record is judged against, measured at the
// start of each run on the same device: the best dense matmul throughput and
// the best copy bandwidth the platform reaches with its vendor libraries.
//
// GPU: cuBLAS GEMM 8192^3 in the benchmark's dtype with fp32 accumulation
// (fp32 without TF32), and a device-to-device cudaMemcpy of 1 GiB.
// CPU: OpenBLAS sgemm 2048^3 (the CPU backend computes in fp32 for every
// dtype), and memcpy of 256 MiB split over the OpenMP threads.
// Bandwidth counts bytes read plus bytes written.
#pragma once

#include <string>

#include "ikbo/tensor.hpp"
#include "timing.hpp"

namespace ikbo::bench {

struct Ceilings {
  double matmul_tflops = 0;
  double bandwidth_gbps = 0;
  std::string matmul_method;  // what was measured, e.g. "cuBLAS fp16 GEMM 8192^3"
  std::string bandwidth_method;

  // Roofline floor in ms of work with `flops` and at least `min_bytes` of traffic.
  double floor_ms(double flops, double min_bytes) const;
};

Ceilings measure_ceilings(const Timer& timer, DType dtype);

}  // namespace ikbo::bench
