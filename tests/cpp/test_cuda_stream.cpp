// CUDA execution properties of the ops, for lce and attention (dense,
// jagged, and with its keys split across CTAs): bitwise-identical results across runs, all work ordered on the
// stream argument with no synchronization inside the call, and capture into
// a CUDA graph (which fails on any allocation or synchronization inside),
// launched three times in a row.
// Every test here skips, with the reason, without a CUDA device.
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "device_harness.hpp"

namespace ikbo::test {
namespace {

constexpr Device kCuda = Device::cuda(0);

// One op with its inputs on the GPU; `enqueue` writes `out` on `stream`.
struct CudaOp {
  DType dtype;
  std::vector<std::int64_t> out_shape;
  std::function<void(Stream stream, const Tensor& out)> enqueue;
};

CudaOp make_lce_op(SeededRng& rng, DType dtype) {
  const std::int64_t m = 433, kc = 866, ku = 1178, n = 64, num_candidates = 128, num_users = 7;
  struct Inputs {
    DeviceTensor e_c, e_u;
    LcePlan plan;
    CandidateMap map;
    DeviceBuffer workspace;
  };
  const DeviceTensor w_c(kCuda, rng.tensor(dtype, {m, kc})), w_u(kCuda, rng.tensor(dtype, {m, ku}));
  const auto cand_to_user = rng.candidate_map(num_candidates, num_users, MapOrder::uneven_unsorted);
  DeviceTensor e_c(kCuda, rng.tensor(dtype, {num_candidates, kc, n}));
  DeviceTensor e_u(kCuda, rng.tensor(dtype, {num_users, ku, n}));
  auto plan = LcePlan::create(w_c.view(), w_u.view());
  auto map = CandidateMap::build(cand_to_user.data(), num_candidates, num_users, kCuda);
  DeviceBuffer workspace(kCuda, lce_workspace_bytes(plan, e_c.view(), e_u.view(), map));
  auto inputs = std::make_shared<Inputs>(Inputs{std::move(e_c), std::move(e_u), std::move(plan),
                                                std::move(map), std::move(workspace)});
  return {dtype, {num_candidates, m, n}, [inputs](Stream stream, const Tensor& out) {
            lce(inputs->plan, inputs->e_c.view(), inputs->e_u.view(), inputs->map, out, stream,
                {inputs->workspace.data(), inputs->workspace.bytes()});
          }};
}

CudaOp make_attention_op(SeededRng& rng, DType dtype, bool jagged) {
  const std::int64_t num_candidates = 70, num_users = 3, n_seed = 64, heads = 2, head_dim = 128,
                     seq_len = 1000;
  const std::vector<std::int32_t> offsets = {0, 1000, 1000, 1333};
  struct Inputs {
    DeviceTensor q, k, v;
    CandidateMap map;
    std::optional<JaggedOffsets> kv_offsets;
  };
  const std::vector<std::int64_t> kv_shape =
      jagged ? std::vector<std::int64_t>{offsets.back(), heads, head_dim}
             : std::vector<std::int64_t>{num_users, seq_len, heads, head_dim};
  const auto cand_to_user = rng.candidate_map(num_candidates, num_users, MapOrder::unsorted);
  auto inputs = std::make_shared<Inputs>(Inputs{
      DeviceTensor(kCuda, rng.tensor(dtype, {num_candidates, n_seed, heads, head_dim}, -2.0, 2.0)),
      DeviceTensor(kCuda, rng.tensor(dtype, kv_shape)),
      DeviceTensor(kCuda, rng.tensor(dtype, kv_shape)),
      CandidateMap::build(cand_to_user.data(), num_candidates, num_users, kCuda), std::nullopt});
  if (jagged) {
    inputs->kv_offsets = JaggedOffsets::build(offsets.data(), num_users, offsets.back(), kCuda);
  }
  return {
      dtype, {num_candidates, n_seed, heads, head_dim}, [inputs](Stream stream, const Tensor& out) {
        attention(inputs->q.view(), inputs->k.view(), inputs->v.view(), inputs->map, out,
                  inputs->kv_offsets ? &*inputs->kv_offsets : nullptr, std::nullopt, stream);
      }};
}

// Few query tiles (one user, 4 candidates x 64 seeds, 2 heads) over 4096
// keys, with the workspace attention_workspace_bytes asks for: on Hopper GPUs
// the keys split across CTAs, and a second launch combines the partials.
CudaOp make_split_keys_attention_op(SeededRng& rng, DType dtype) {
  const std::int64_t num_candidates = 4, num_users = 1, n_seed = 64, heads = 2, head_dim = 128,
                     seq_len = 4096;
  struct Inputs {
    DeviceTensor q, k, v;
    CandidateMap map;
    DeviceBuffer workspace;
  };
  const std::vector<std::int32_t> cand_to_user(num_candidates, 0);
  DeviceTensor q(kCuda, rng.tensor(dtype, {num_candidates, n_seed, heads, head_dim}, -2.0, 2.0));
  DeviceTensor k(kCuda, rng.tensor(dtype, {num_users, seq_len, heads, head_dim}));
  DeviceTensor v(kCuda, rng.tensor(dtype, {num_users, seq_len, heads, head_dim}));
  auto map = CandidateMap::build(cand_to_user.data(), num_candidates, num_users, kCuda);
  DeviceBuffer workspace(kCuda, attention_workspace_bytes(q.view(), k.view(), v.view(), map));
  auto inputs = std::make_shared<Inputs>(Inputs{std::move(q), std::move(k), std::move(v),
                                                std::move(map), std::move(workspace)});
  return {dtype, {num_candidates, n_seed, heads, head_dim},
          [inputs](Stream stream, const Tensor& out) {
            attention(inputs->q.view(), inputs->k.view(), inputs->v.view(), inputs->map, out,
                      nullptr, std::nullopt, stream,
                      {inputs->workspace.data(), inputs->workspace.bytes()});
          }};
}

struct CudaOpFactory {
  const char* name;
  std::function<CudaOp(SeededRng&)> make;
};

void PrintTo(const CudaOpFactory& value, std::ostream* stream) { *stream << value.name; }

const std::vector<CudaOpFactory>& cuda_ops() {
  static const std::vector<CudaOpFactory> ops = {
      {"lce_f16", [](SeededRng& rng) { return make_lce_op(rng, DType::f16); }},
      {"lce_bf16", [](SeededRng& rng) { return make_lce_op(rng, DType::bf16); }},
      {"lce_f32", [](SeededRng& rng) { return make_lce_op(rng, DType::f32); }},
      {"attention_dense_f16",
       [](SeededRng& rng) { return make_attention_op(rng, DType::f16, false); }},
      {"attention_dense_f32",
       [](SeededRng& rng) { return make_attention_op(rng, DType::f32, false); }},
      {"attention_jagged_f16",
       [](SeededRng& rng) { return make_attention_op(rng, DType::f16, true); }},
      {"attention_jagged_bf16",
       [](SeededRng& rng) { return make_attention_op(rng, DType::bf16, true); }},
      {"attention_split_keys_f16",
       [](SeededRng& rng) { return make_split_keys_attention_op(rng, DType::f16); }},
  };
  return ops;
}

class CudaExecution : public testing::TestWithParam<CudaOpFactory> {
 protected:
  void SetUp() override { IKBO_SKIP_IF_UNAVAILABLE(kCuda); }

  // Runs the op on the legacy default stream into a poisoned output.
  static std::vector<std::byte> run_eagerly(const CudaOp& op) {
    const auto out = DeviceTensor::poisoned(kCuda, op.dtype, op.out_shape);
    op.enqueue(nullptr, out.view());
    const auto bytes = out.bytes();
    EXPECT_TRUE(fully_written(decode(bytes, op.dtype)));
    return bytes;
  }
};

TEST_P(CudaExecution, RepeatedRunsAreBitwiseIdentical) {
  SeededRng rng;
  const CudaOp op = GetParam().make(rng);
  const auto first = run_eagerly(op);
  const auto second = run_eagerly(op);
  EXPECT_TRUE(first == second) << "two runs on identical inputs differ";
}

// A gate holds the stream back while the op is called: if any of the op's
// work went to another stream, out is written before the gate opens; if the
// call synchronized, it returns only after the gate gave up.
TEST_P(CudaExecution, RunsOnTheGivenStreamWithoutSynchronizing) {
  SeededRng rng;
  const CudaOp op = GetParam().make(rng);
  const auto expected = run_eagerly(op);
  const TestStream stream(kCuda);
  const auto out = DeviceTensor::poisoned(kCuda, op.dtype, op.out_shape);
  const auto poisoned = out.bytes();
  {
    StreamGate gate(stream, std::chrono::seconds(10));
    op.enqueue(stream.handle(), out.view());
    EXPECT_FALSE(gate.timed_out())
        << "the call returned only after the blocked stream gave up: it synchronized";
    EXPECT_TRUE(out.bytes() == poisoned)
        << "out was written while its stream was still blocked: work ran on another stream";
    gate.release();
  }
  stream.synchronize();
  EXPECT_TRUE(out.bytes() == expected) << "the result on a created stream differs";
}

TEST_P(CudaExecution, CapturesIntoACudaGraph) {
  SeededRng rng;
  const CudaOp op = GetParam().make(rng);
  const auto expected = run_eagerly(op);
  const TestStream stream(kCuda);
  const auto out = DeviceTensor::poisoned(kCuda, op.dtype, op.out_shape);
  // Three launches in a row: each must find its workspace as it needs it
  // (lce's flags zeroed by the memset node before its kernel).
  run_as_cuda_graph(stream, [&] { op.enqueue(stream.handle(), out.view()); }, 3);
  EXPECT_TRUE(out.bytes() == expected) << "the graph replays differ from the eager run";
}

INSTANTIATE_TEST_SUITE_P(Ops, CudaExecution, testing::ValuesIn(cuda_ops()),
                         [](const testing::TestParamInfo<CudaOpFactory>& info) {
                           return std::string(info.param.name);
                         });

}  // namespace
}  // namespace ikbo::test
