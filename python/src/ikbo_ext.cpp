// ikbo._C — the compiled core of the `ikbo` Python package (nanobind).
//
// Arrays arrive through DLPack as nb::ndarray (numpy on the CPU; torch, cupy
// or jax on the CPU or a CUDA device) and become non-owning ikbo::Tensor
// views: dtype float16, bfloat16 or float32 (int32 for cand_to_user and
// kv_offsets, which may also be lists of ints), device cpu or
// cuda:<ordinal>, dense row-major only (a strided array is refused, never
// silently copied). Everything beyond that — shapes, dtypes and devices
// against each other, the candidate map — is validated by the library, whose
// ikbo::Error derives from std::invalid_argument and so reaches Python as
// ValueError carrying the library's message. Errors found here are raised
// the same way.
//
// Op calls release the GIL. CUDA ops run asynchronously on the stream given
// as an integer (a cudaStream_t; 0 is the legacy default stream) and use the
// caller's workspace: nothing here allocates device memory.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "baselines.hpp"
#include "ikbo/ikbo.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// Inputs are only read, so read-only arrays are accepted; outputs and the
// workspace must be writable (nanobind refuses read-only arrays for these).
using InputArray = nb::ndarray<nb::ro>;
using OutputArray = nb::ndarray<>;
// A read-only numpy view of an int32 array owned by a map or offsets object.
using Int32View = nb::ndarray<nb::numpy, const std::int32_t, nb::ndim<1>>;

template <typename... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::ostringstream message;
  (message << ... << parts);
  throw ikbo::Error(message.str());
}

// numpy-style name of a DLPack dtype for messages: "float64", "int64", "bool".
std::string dlpack_dtype_name(nb::dlpack::dtype dtype) {
  using Code = nb::dlpack::dtype_code;
  const char* kind = nullptr;
  switch (static_cast<Code>(dtype.code)) {
    case Code::Int: kind = "int"; break;
    case Code::UInt: kind = "uint"; break;
    case Code::Float: kind = "float"; break;
    case Code::Bfloat: kind = "bfloat"; break;
    case Code::Complex: kind = "complex"; break;
    case Code::Bool: return "bool";
    default:
      return "DLPack type code " + std::to_string(dtype.code) + " of " +
             std::to_string(dtype.bits) + " bits";
  }
  std::string name = kind + std::to_string(dtype.bits);
  if (dtype.lanes != 1) name += "x" + std::to_string(dtype.lanes);
  return name;
}

// The element types an argument takes: the map and the offsets are int32,
// everything else one of the float types.
enum class Elements { floating, int32 };

ikbo::DType to_dtype(nb::dlpack::dtype dtype, std::string_view name, Elements elements) {
  using Code = nb::dlpack::dtype_code;
  if (dtype == nb::dtype<float>()) return ikbo::DType::f32;
  if (dtype == nb::dtype<std::int32_t>()) return ikbo::DType::i32;
  if (dtype == nb::dlpack::dtype{static_cast<std::uint8_t>(Code::Float), 16, 1}) {
    return ikbo::DType::f16;
  }
  if (dtype == nb::dlpack::dtype{static_cast<std::uint8_t>(Code::Bfloat), 16, 1}) {
    return ikbo::DType::bf16;
  }
  fail(name, " has dtype ", dlpack_dtype_name(dtype), ", which ikbo does not take: ", name,
       " must be ", elements == Elements::int32 ? "int32" : "float16, bfloat16 or float32");
}

ikbo::Device to_device(int device_type, int device_id, std::string_view name) {
  // Pinned host memory (kDLCUDAHost) is ordinary memory to the CPU backend.
  if (device_type == nb::device::cpu::value || device_type == nb::device::cuda_host::value) {
    return ikbo::Device::cpu();
  }
  if (device_type == nb::device::cuda::value) return ikbo::Device::cuda(device_id);
  fail(name, " is on DLPack device type ", device_type,
       ", but ikbo takes tensors on the CPU or a CUDA device");
}

template <typename Array>
std::string extents_string(const Array& array, bool strides) {
  std::string text = "[";
  for (std::size_t dim = 0; dim < array.ndim(); ++dim) {
    if (dim) text += ", ";
    text +=
        std::to_string(strides ? array.stride(dim) : static_cast<std::int64_t>(array.shape(dim)));
  }
  return text + "]";
}

// The library's views carry no strides: refuse anything that is not dense
// row-major. Extents of 1 may have any stride (frameworks differ there), and
// an empty array has no layout to get wrong.
template <typename Array>
void check_row_major(const Array& array, std::string_view name) {
  std::int64_t expected_stride = 1;
  bool row_major = true;
  for (std::size_t dim = array.ndim(); dim-- > 0;) {
    const auto extent = static_cast<std::int64_t>(array.shape(dim));
    if (extent == 0) return;
    if (extent != 1 && array.stride(dim) != expected_stride) row_major = false;
    expected_stride *= extent;
  }
  if (!row_major) {
    fail(name, " must be contiguous (row-major), got strides ", extents_string(array, true),
         " (in elements) for shape ", extents_string(array, false));
  }
}

template <typename Array>
ikbo::Tensor to_tensor(const Array& array, std::string_view name,
                       Elements elements = Elements::floating) {
  if (array.ndim() > static_cast<std::size_t>(ikbo::kMaxRank)) {
    fail(name, " has ", array.ndim(), " dimensions (shape ", extents_string(array, false),
         "), but ikbo tensors have at most ", ikbo::kMaxRank);
  }
  check_row_major(array, name);
  ikbo::Tensor tensor;
  // Views are untyped and non-const by design; the ops only read their inputs.
  tensor.data = const_cast<void*>(static_cast<const void*>(array.data()));
  tensor.dtype = to_dtype(array.dtype(), name, elements);
  tensor.device = to_device(array.device_type(), array.device_id(), name);
  tensor.rank = static_cast<int>(array.ndim());
  for (int dim = 0; dim < tensor.rank; ++dim) {
    tensor.shape[static_cast<std::size_t>(dim)] =
        static_cast<std::int64_t>(array.shape(static_cast<std::size_t>(dim)));
  }
  return tensor;
}

ikbo::Stream to_stream(std::uintptr_t stream) { return reinterpret_cast<ikbo::Stream>(stream); }

// A caller's buffer (an op's workspace, a map's storage) as the library's
// Workspace; `owner`: what names the device in the error (e.g. "the plan"),
// `name` the argument.
ikbo::Workspace to_workspace(const std::optional<OutputArray>& workspace, ikbo::Device device,
                             std::string_view owner, std::string_view name = "workspace") {
  if (!workspace) return {};
  check_row_major(*workspace, name);
  const ikbo::Device where = to_device(workspace->device_type(), workspace->device_id(), name);
  if (workspace->nbytes() != 0 && where != device) {
    fail(name, " must be on ", ikbo::device_name(device), " like ", owner, ", got ",
         ikbo::device_name(where));
  }
  return {workspace->data(), workspace->nbytes()};
}

// The storage argument of a map or offsets class, as its docstrings say it.
constexpr const char* kStorageDoc =
    "`storage`: None (the object allocates its device copy, with cudaMalloc; dropping it\n"
    "calls cudaFree, and both synchronize the device), or a writable buffer on the same\n"
    "CUDA device of at least device_bytes() bytes, 256-byte aligned, that holds the copy\n"
    "instead: from torch.empty, say, which takes it from torch's caching allocator. The\n"
    "object keeps `storage` alive; nothing else may write it while the object is used.";

Int32View int32_view(std::span<const std::int32_t> values) {
  // An empty std::vector may have a null data pointer, which numpy does not
  // accept even for a zero-length array.
  static const std::int32_t empty_storage = 0;
  return Int32View(values.empty() ? &empty_storage : values.data(), {values.size()});
}

std::string python_bool(bool value) { return value ? "True" : "False"; }

// str(value), as Python prints it.
std::string python_str(nb::handle value) { return nb::cast<std::string>(value.attr("__str__")()); }

// cand_to_user or kv_offsets: any DLPack tensor, or a list or tuple of ints,
// which numpy makes an int32 array. The op wrappers pass their mappings and
// offsets through here, so they and the classes take the same inputs.
InputArray int32_input(nb::handle value, std::string_view name) {
  nb::object source = nb::borrow(value);
  if (nb::isinstance<nb::list>(value) || nb::isinstance<nb::tuple>(value)) {
    // Converted as numpy reads the values, then checked: a cast to int32
    // straight away would truncate 1.5 to 1 and wrap 2^32 to 0 silently.
    nb::object values = nb::module_::import_("numpy").attr("asarray")(value);
    if (nb::cast<std::int64_t>(values.attr("size")) > 0) {
      const auto kind = nb::cast<std::string>(values.attr("dtype").attr("kind"));
      if (kind != "i" && kind != "u") {
        fail(name, " must be a list of ints, got elements numpy reads as ",
             nb::cast<std::string>(values.attr("dtype").attr("name")));
      }
      for (const char* end : {"min", "max"}) {
        const auto extreme = nb::cast<double>(values.attr(end)());
        if (extreme < std::numeric_limits<std::int32_t>::min() ||
            extreme > std::numeric_limits<std::int32_t>::max()) {
          fail(name, " holds ", python_str(values.attr(end)()),
               ", outside the int32 range");
        }
      }
    }
    source = values.attr("astype")("int32");
  }
  InputArray array;
  if (!nb::try_cast(source, array)) {
    std::string given = nb::type_name(value.type()).c_str();
    if (nb::hasattr(value, "dtype")) {
      given += " of dtype " + python_str(value.attr("dtype"));
    }
    fail(name, " must be an int32 tensor (numpy, torch, ... through DLPack) or a list of ints",
         ", got ", given, ", which does not export through DLPack");
  }
  return array;
}

void bind_candidate_map(nb::module_& m) {
  nb::class_<ikbo::CandidateMap>(
      m, "CandidateMap",
      "The request-level candidate -> user map, built once per request and passed to every\n"
      "op of that request. Building validates every entry of cand_to_user once and derives\n"
      "per-user counts and offsets, sortedness and the largest group; for a CUDA tensor the\n"
      "derived arrays also live on its device. Immutable.")
      .def(
          "__init__",
          [](ikbo::CandidateMap* self, nb::handle cand_to_user, std::int64_t num_users,
             std::uintptr_t stream, nb::handle levels, std::optional<OutputArray> storage) {
            if (!levels.is_none() && !nb::isinstance<nb::list>(levels) &&
                !nb::isinstance<nb::tuple>(levels)) {
              const std::string given = nb::type_name(levels.type()).c_str();
              throw nb::type_error(
                  ("levels must be a list or tuple of index tensors, or None, got " + given)
                      .c_str());
            }
            const InputArray array = int32_input(cand_to_user, "cand_to_user");
            const ikbo::Tensor view = to_tensor(array, "cand_to_user", Elements::int32);
            std::vector<InputArray> level_arrays;  // keep the levels' exports alive
            std::vector<ikbo::Tensor> level_views;
            for (std::size_t i = 0; !levels.is_none() && i < nb::len(levels); ++i) {
              const std::string name = "levels[" + std::to_string(i) + "]";
              level_arrays.push_back(int32_input(levels[i], name));
              level_views.push_back(to_tensor(level_arrays.back(), name, Elements::int32));
            }
            const ikbo::Workspace buffer =
                to_workspace(storage, view.device, "cand_to_user", "storage");
            nb::gil_scoped_release release;
            new (self) ikbo::CandidateMap(
                ikbo::CandidateMap::build(view, level_views, num_users, to_stream(stream), buffer));
          },
          "cand_to_user"_a.none(), "num_users"_a, "stream"_a = 0, "levels"_a.none() = nb::none(),
          "storage"_a.none() = nb::none(), nb::keep_alive<1, 6>(),
          ("Builds the map from a 1-D int32 tensor of B entries in [0, num_users), on the CPU\n"
           "or a CUDA device (the map lives where the tensor is), or from a list of ints.\n"
           "`stream` orders the device copies, which are synchronized before returning.\n"
           "`levels`: a request of more levels (user -> vendor -> candidate, say): cand_to_user\n"
           "maps the candidates to the groups of levels[0] (its entries), each level its groups\n"
           "to the next level's, the last to the num_users users; the map of each candidate\n"
           "to its user, as compose() of each level's map gives, with every tensor read once\n"
           "and only the result copied to the device. All on one device; an error names the\n"
           "level.\n" +
           std::string(kStorageDoc))
              .c_str())
      .def_static(
          "compose",
          [](const ikbo::CandidateMap& to_group, const ikbo::CandidateMap& group_to_user,
             std::uintptr_t stream, std::optional<OutputArray> storage) {
            const ikbo::Workspace buffer =
                to_workspace(storage, to_group.device(), "to_group", "storage");
            nb::gil_scoped_release release;
            return ikbo::CandidateMap::compose(to_group, group_to_user, to_stream(stream), buffer);
          },
          "to_group"_a, "group_to_user"_a, "stream"_a = 0, "storage"_a.none() = nb::none(),
          nb::keep_alive<0, 4>(),
          "Multi-level broadcast (user -> group -> candidate): the map of each candidate to\n"
          "its group's user, group_to_user.cand_to_user[to_group.cand_to_user]. to_group maps\n"
          "B candidates to G groups, group_to_user those G groups to U users; both on one\n"
          "device, where the result lives. `storage` as for the constructor.")
      .def_static("device_bytes", &ikbo::CandidateMap::device_bytes, "num_candidates"_a,
                  "num_users"_a,
                  "Bytes of `storage` a CUDA map of num_candidates candidates and num_users\n"
                  "users needs.")
      .def_prop_ro("num_candidates", &ikbo::CandidateMap::num_candidates, "B")
      .def_prop_ro("num_users", &ikbo::CandidateMap::num_users, "U")
      .def_prop_ro("is_sorted", &ikbo::CandidateMap::is_sorted, "cand_to_user is non-decreasing")
      .def_prop_ro("max_count", &ikbo::CandidateMap::max_count,
                   "candidates of the largest user group (0 when B = 0)")
      .def_prop_ro(
          "device", [](const ikbo::CandidateMap& map) { return ikbo::device_name(map.device()); },
          "'cpu' or 'cuda:<ordinal>'")
      .def_prop_ro(
          "cand_to_user",
          [](const ikbo::CandidateMap& map) { return int32_view(map.cand_to_user()); },
          nb::rv_policy::reference_internal, "read-only numpy int32 [B], the mapping")
      .def_prop_ro(
          "user_counts",
          [](const ikbo::CandidateMap& map) { return int32_view(map.user_counts()); },
          nb::rv_policy::reference_internal, "read-only numpy int32 [U], candidates per user")
      .def_prop_ro(
          "user_offsets",
          [](const ikbo::CandidateMap& map) { return int32_view(map.user_offsets()); },
          nb::rv_policy::reference_internal,
          "read-only numpy int32 [U + 1]; user u's group in candidates_by_user is\n"
          "[user_offsets[u], user_offsets[u + 1])")
      .def_prop_ro(
          "candidates_by_user",
          [](const ikbo::CandidateMap& map) { return int32_view(map.candidates_by_user()); },
          nb::rv_policy::reference_internal,
          "read-only numpy int32 [B], candidate ids grouped by user (stable)")
      .def("__repr__", [](const ikbo::CandidateMap& map) {
        return "CandidateMap(num_candidates=" + std::to_string(map.num_candidates()) +
               ", num_users=" + std::to_string(map.num_users()) + ", device='" +
               ikbo::device_name(map.device()) + "', is_sorted=" + python_bool(map.is_sorted()) +
               ", max_count=" + std::to_string(map.max_count()) + ")";
      });
}

void bind_jagged_offsets(nb::module_& m) {
  nb::class_<ikbo::JaggedOffsets>(
      m, "JaggedOffsets",
      "Offsets [U + 1] of a jagged per-user sequence such as variable-length K/V\n"
      "histories: user u owns rows [offsets[u], offsets[u + 1]). Validated once\n"
      "(starts at 0, non-decreasing, ends at total_rows). Immutable.")
      .def(
          "__init__",
          [](ikbo::JaggedOffsets* self, nb::handle offsets, std::int64_t total_rows,
             std::uintptr_t stream, std::optional<OutputArray> storage) {
            const InputArray array = int32_input(offsets, "kv_offsets");
            const ikbo::Tensor view = to_tensor(array, "kv_offsets", Elements::int32);
            const ikbo::Workspace buffer =
                to_workspace(storage, view.device, "kv_offsets", "storage");
            nb::gil_scoped_release release;
            new (self) ikbo::JaggedOffsets(
                ikbo::JaggedOffsets::build(view, total_rows, to_stream(stream), buffer));
          },
          "offsets"_a.none(), "total_rows"_a, "stream"_a = 0, "storage"_a.none() = nb::none(),
          nb::keep_alive<1, 5>(),
          ("Builds the offsets from a 1-D int32 tensor of U + 1 entries on the CPU or a CUDA\n"
           "device (they live where the tensor is), or from a list of ints.\n" +
           std::string(kStorageDoc))
              .c_str())
      .def_static("device_bytes", &ikbo::JaggedOffsets::device_bytes, "num_users"_a,
                  "Bytes of `storage` CUDA offsets of num_users users need.")
      .def_prop_ro("num_users", &ikbo::JaggedOffsets::num_users, "U")
      .def_prop_ro("total_rows", &ikbo::JaggedOffsets::total_rows, "rows of the jagged tensor")
      .def_prop_ro("max_length", &ikbo::JaggedOffsets::max_length, "the longest user sequence")
      .def_prop_ro(
          "device",
          [](const ikbo::JaggedOffsets& offsets) { return ikbo::device_name(offsets.device()); },
          "'cpu' or 'cuda:<ordinal>'")
      .def_prop_ro(
          "offsets", [](const ikbo::JaggedOffsets& offsets) { return int32_view(offsets.host()); },
          nb::rv_policy::reference_internal, "read-only numpy int32 [U + 1]")
      .def("__repr__", [](const ikbo::JaggedOffsets& offsets) {
        return "JaggedOffsets(num_users=" + std::to_string(offsets.num_users()) +
               ", total_rows=" + std::to_string(offsets.total_rows()) +
               ", max_length=" + std::to_string(offsets.max_length()) + ", device='" +
               ikbo::device_name(offsets.device()) + "')";
      });
}

// Binds an op called as op(plan, candidate side, user side, map, out,
// stream, workspace): lce and its fused baseline (e_c, e_u), linear (x_c,
// x_u). The arrays' names are the Python keywords and name them in errors.
template <class Plan>
using PlanOp = void(const Plan&, const ikbo::Tensor&, const ikbo::Tensor&,
                    const ikbo::CandidateMap&, const ikbo::Tensor&, ikbo::Stream, ikbo::Workspace);

template <class Plan>
void def_plan_op(nb::module_& m, const char* name, PlanOp<Plan>* op, const char* candidate_side,
                 const char* user_side, const char* doc) {
  m.def(
      name,
      [op, candidate_side, user_side](const Plan& plan, InputArray candidates, InputArray users,
                                      const ikbo::CandidateMap& map, OutputArray out,
                                      std::uintptr_t stream, std::optional<OutputArray> workspace) {
        const ikbo::Tensor candidate_view = to_tensor(candidates, candidate_side);
        const ikbo::Tensor user_view = to_tensor(users, user_side);
        const ikbo::Tensor out_view = to_tensor(out, "out");
        const ikbo::Workspace scratch = to_workspace(workspace, plan.device(), "the plan");
        nb::gil_scoped_release release;
        op(plan, candidate_view, user_view, map, out_view, to_stream(stream), scratch);
      },
      "plan"_a, nb::arg(candidate_side), nb::arg(user_side), "map"_a, "out"_a, "stream"_a = 0,
      "workspace"_a.none() = nb::none(), doc);
}

void bind_lce(nb::module_& m) {
  nb::class_<ikbo::LcePlan>(
      m, "LcePlan",
      "LCE weights prepared once and reused by every request: w_c [M, Kc] and\n"
      "w_u [M, Ku] of one dtype on one device. Holds its own copy of the weights.")
      .def(
          "__init__",
          [](ikbo::LcePlan* self, InputArray w_c, InputArray w_u, std::uintptr_t stream) {
            const ikbo::Tensor w_c_view = to_tensor(w_c, "w_c");
            const ikbo::Tensor w_u_view = to_tensor(w_u, "w_u");
            nb::gil_scoped_release release;
            new (self) ikbo::LcePlan(ikbo::LcePlan::create(w_c_view, w_u_view, to_stream(stream)));
          },
          "w_c"_a, "w_u"_a, "stream"_a = 0,
          "Prepares the weights; on CUDA the copy is ordered on `stream` and synchronized.")
      .def_prop_ro(
          "dtype",
          [](const ikbo::LcePlan& plan) { return std::string(ikbo::dtype_name(plan.dtype())); },
          "'float16', 'bfloat16' or 'float32'")
      .def_prop_ro(
          "device", [](const ikbo::LcePlan& plan) { return ikbo::device_name(plan.device()); },
          "'cpu' or 'cuda:<ordinal>'")
      .def_prop_ro("m", &ikbo::LcePlan::m, "M, output rows per candidate")
      .def_prop_ro("ku", &ikbo::LcePlan::ku, "Ku, the user-side K")
      .def_prop_ro("kc", &ikbo::LcePlan::kc, "Kc, the candidate-side K")
      .def("__repr__", [](const ikbo::LcePlan& plan) {
        return "LcePlan(m=" + std::to_string(plan.m()) + ", ku=" + std::to_string(plan.ku()) +
               ", kc=" + std::to_string(plan.kc()) + ", dtype='" + ikbo::dtype_name(plan.dtype()) +
               "', device='" + ikbo::device_name(plan.device()) + "')";
      });

  m.def(
      "lce_workspace_bytes",
      [](const ikbo::LcePlan& plan, InputArray e_c, InputArray e_u, const ikbo::CandidateMap& map) {
        return ikbo::lce_workspace_bytes(plan, to_tensor(e_c, "e_c"), to_tensor(e_u, "e_u"), map);
      },
      "plan"_a, "e_c"_a, "e_u"_a, "map"_a,
      "Bytes of workspace lce() needs for these inputs (0 on the CPU). Validates the\n"
      "inputs against the plan and the map exactly as lce() does.");
  m.def(
      "lce_workspace_bytes",
      [](const ikbo::LcePlan& plan, std::int64_t n, std::int64_t num_candidates,
         std::int64_t num_users) {
        return ikbo::lce_workspace_bytes(plan, n, num_candidates, num_users);
      },
      "plan"_a, "n"_a, "num_candidates"_a, "num_users"_a,
      "The same from the sizes alone: N, B and U of e_c [B, Kc, N] and e_u [U, Ku, N]\n"
      "(no array to export: the cheaper query when the inputs are at hand anyway).");

  def_plan_op<ikbo::LcePlan>(
      m, "lce", &ikbo::lce, "e_c", "e_u",
      "out[b] = w_c @ e_c[b] + w_u @ e_u[map.cand_to_user[b]], written into out [B, M, N].\n"
      "e_c [B, Kc, N], e_u [U, Ku, N], dense row-major, the plan's dtype and device.\n"
      "On CUDA: asynchronous on `stream`; `workspace` is a writable buffer on the plan's\n"
      "device of at least lce_workspace_bytes() bytes. Raises ValueError, with out\n"
      "untouched, on any invalid argument.");
}

// Stages of the published staircase that only the library can run, for the
// Python bench (not part of the API).
void bind_baselines(nb::module_& m) {
  nb::module_ baseline = m.def_submodule(
      "baseline", "Benchmark baselines the library runs (not part of ikbo's API).");
  baseline.def(
      "lce_fused_blocker",
      [](const ikbo::LcePlan& plan, InputArray e_c, InputArray e_u, const ikbo::CandidateMap& map,
         OutputArray out, std::optional<OutputArray> workspace) {
        return ikbo::baseline::lce_fused_blocker(
            plan, to_tensor(e_c, "e_c"), to_tensor(e_u, "e_u"), map, to_tensor(out, "out"),
            to_workspace(workspace, plan.device(), "the plan"));
      },
      "plan"_a, "e_c"_a, "e_u"_a, "map"_a, "out"_a, "workspace"_a.none() = nb::none(),
      "Why lce_fused cannot run this call here (not a Hopper GPU, a shape its kernel\n"
      "does not take, ...), or None.");
  def_plan_op<ikbo::LcePlan>(
      baseline, "lce_fused", &ikbo::baseline::lce_fused, "e_c", "e_u",
      "The published stage 3 (broadcast fusion): lce's call (same arguments, same\n"
      "workspace) on the Hopper kernel with the user GEMM in a launch of its own, then\n"
      "the candidate GEMM adding the user partial in its epilogue. Raises ValueError on\n"
      "an invalid argument, RuntimeError with lce_fused_blocker's reason where it cannot\n"
      "run; out is untouched either way.");
}

std::optional<ikbo::Tensor> optional_tensor(const std::optional<InputArray>& array,
                                            std::string_view name) {
  if (!array) return std::nullopt;
  return to_tensor(*array, name);
}

void bind_linear(nb::module_& m) {
  nb::class_<ikbo::LinearPlan>(
      m, "LinearPlan",
      "Linear-layer weights prepared once and reused by every request: w_u [N_out, Ku],\n"
      "w_c [N_out, Kc] (the user and candidate column blocks of torch's weight) and an\n"
      "optional bias [N_out], of one dtype on one device. Holds its own copy.")
      .def(
          "__init__",
          [](ikbo::LinearPlan* self, InputArray w_u, InputArray w_c,
             std::optional<InputArray> bias, std::uintptr_t stream) {
            const ikbo::Tensor w_u_view = to_tensor(w_u, "w_u");
            const ikbo::Tensor w_c_view = to_tensor(w_c, "w_c");
            const std::optional<ikbo::Tensor> bias_view = optional_tensor(bias, "bias");
            nb::gil_scoped_release release;
            new (self) ikbo::LinearPlan(ikbo::LinearPlan::create(
                w_u_view, w_c_view, bias_view ? &*bias_view : nullptr, to_stream(stream)));
          },
          "w_u"_a, "w_c"_a, "bias"_a.none() = nb::none(), "stream"_a = 0,
          "Prepares the weights; on CUDA the copy is ordered on `stream` and synchronized.")
      .def_static(
          "from_concatenated",
          [](InputArray weight, std::int64_t num_user_features, std::optional<InputArray> bias,
             std::uintptr_t stream) {
            const ikbo::Tensor weight_view = to_tensor(weight, "weight");
            const std::optional<ikbo::Tensor> bias_view = optional_tensor(bias, "bias");
            nb::gil_scoped_release release;
            return ikbo::LinearPlan::from_concatenated(weight_view, num_user_features,
                                                       bias_view ? &*bias_view : nullptr,
                                                       to_stream(stream));
          },
          "weight"_a, "num_user_features"_a, "bias"_a.none() = nb::none(), "stream"_a = 0,
          "Prepares torch's weight [N_out, Ku + Kc] = [w_u | w_c], split after its first\n"
          "num_user_features (Ku) columns, and the optional bias [N_out].")
      .def_prop_ro(
          "dtype",
          [](const ikbo::LinearPlan& plan) { return std::string(ikbo::dtype_name(plan.dtype())); },
          "'float16', 'bfloat16' or 'float32'")
      .def_prop_ro(
          "device", [](const ikbo::LinearPlan& plan) { return ikbo::device_name(plan.device()); },
          "'cpu' or 'cuda:<ordinal>'")
      .def_prop_ro("out_features", &ikbo::LinearPlan::out_features, "N_out")
      .def_prop_ro("ku", &ikbo::LinearPlan::ku, "Ku, the number of user features")
      .def_prop_ro("kc", &ikbo::LinearPlan::kc, "Kc, the number of candidate features")
      .def_prop_ro("has_bias", &ikbo::LinearPlan::has_bias, "whether the plan adds a bias")
      .def("__repr__", [](const ikbo::LinearPlan& plan) {
        return "LinearPlan(out_features=" + std::to_string(plan.out_features()) +
               ", ku=" + std::to_string(plan.ku()) + ", kc=" + std::to_string(plan.kc()) +
               ", has_bias=" + python_bool(plan.has_bias()) + ", dtype='" +
               ikbo::dtype_name(plan.dtype()) + "', device='" + ikbo::device_name(plan.device()) +
               "')";
      });

  m.def(
      "linear_workspace_bytes",
      [](const ikbo::LinearPlan& plan, InputArray x_c, InputArray x_u,
         const ikbo::CandidateMap& map) {
        return ikbo::linear_workspace_bytes(plan, to_tensor(x_c, "x_c"), to_tensor(x_u, "x_u"),
                                            map);
      },
      "plan"_a, "x_c"_a, "x_u"_a, "map"_a,
      "Bytes of workspace linear() needs for these inputs (0 on the CPU). Validates the\n"
      "inputs against the plan and the map exactly as linear() does.");
  m.def(
      "linear_workspace_bytes",
      [](const ikbo::LinearPlan& plan, std::int64_t num_candidates, std::int64_t num_users) {
        return ikbo::linear_workspace_bytes(plan, num_candidates, num_users);
      },
      "plan"_a, "num_candidates"_a, "num_users"_a,
      "The same from the sizes alone: B and U of x_c [B, Kc] and x_u [U, Ku] (no array\n"
      "to export: the cheaper query when the inputs are at hand anyway).");

  def_plan_op<ikbo::LinearPlan>(
      m, "linear", &ikbo::linear, "x_c", "x_u",
      "out[b] = x_c[b] @ w_c^T + x_u[map.cand_to_user[b]] @ w_u^T + bias, written into\n"
      "out [B, N_out]. x_c [B, Kc], x_u [U, Ku], dense row-major, the plan's dtype and\n"
      "device. On CUDA: asynchronous on `stream`; `workspace` is a writable buffer on the\n"
      "plan's device of at least linear_workspace_bytes() bytes. Raises ValueError, with\n"
      "out untouched, on any invalid argument.");
}

void bind_attention(nb::module_& m) {
  m.def(
      "attention_workspace_bytes",
      [](InputArray q, InputArray k, InputArray v, const ikbo::CandidateMap& map,
         const ikbo::JaggedOffsets* kv_offsets) {
        return ikbo::attention_workspace_bytes(to_tensor(q, "q"), to_tensor(k, "k"),
                                               to_tensor(v, "v"), map, kv_offsets);
      },
      "q"_a, "k"_a, "v"_a, "map"_a, "kv_offsets"_a.none() = nb::none(),
      "Bytes of workspace attention() can use for these inputs (0 on the CPU, on GPUs\n"
      "without the Hopper path and for calls with enough query tiles). Validates the\n"
      "arguments as attention() does.");
  m.def(
      "attention",
      [](InputArray q, InputArray k, InputArray v, const ikbo::CandidateMap& map, OutputArray out,
         const ikbo::JaggedOffsets* kv_offsets, std::optional<float> scale, std::uintptr_t stream,
         std::optional<OutputArray> workspace) {
        const ikbo::Tensor q_view = to_tensor(q, "q");
        const ikbo::Tensor k_view = to_tensor(k, "k");
        const ikbo::Tensor v_view = to_tensor(v, "v");
        const ikbo::Tensor out_view = to_tensor(out, "out");
        const ikbo::Workspace scratch = to_workspace(workspace, q_view.device, "q");
        nb::gil_scoped_release release;
        ikbo::attention(q_view, k_view, v_view, map, out_view, kv_offsets, scale,
                        to_stream(stream), scratch);
      },
      "q"_a, "k"_a, "v"_a, "map"_a, "out"_a, "kv_offsets"_a.none() = nb::none(),
      "scale"_a.none() = nb::none(), "stream"_a = 0, "workspace"_a.none() = nb::none(),
      "out[b, :, h, :] = softmax(scale * q[b, :, h, :] @ k_u[:, h, :]^T) @ v_u[:, h, :], with\n"
      "u = map.cand_to_user[b]. q, out [B, n_seed, H, D]; k, v dense [U, S, H, D], or jagged\n"
      "[total, H, D] with kv_offsets. scale defaults to 1/sqrt(D); users with no keys get\n"
      "zeros. On CUDA: asynchronous on `stream`; `workspace` (optional) is a writable\n"
      "buffer on q's device of at least attention_workspace_bytes() bytes, with which a\n"
      "call of few query tiles splits their keys across more SMs. Raises ValueError,\n"
      "with out untouched, on any invalid argument.");
}

// nanobind lists the ikbo objects still alive when the extension is torn
// down at exit. A user's module-level plan or map often is, by no fault of
// theirs: torch.compile's guards and torch custom ops keep __main__'s globals
// past that point. A "leak" report only ikbo's developers can act on would
// alarm everyone else, so it is printed only with IKBO_LEAK_WARNINGS set to
// anything but "" or "0" (the leak tests of the torch layer set it).
bool leak_warnings_requested() {
  const char* value = std::getenv("IKBO_LEAK_WARNINGS");
  return value != nullptr && !std::string_view(value).empty() && std::string_view(value) != "0";
}

}  // namespace

NB_MODULE(_C, m) {
  nb::set_leak_warnings(leak_warnings_requested());
  m.doc() =
      "ikbo._C: in-kernel broadcast ops for recommendation inference (nanobind bindings).\n"
      "Use the friendlier wrappers in the `ikbo` package.";
  m.attr("__version__") = IKBO_VERSION;
  m.def("built_with_cuda", &ikbo::built_with_cuda,
        "True when the library was compiled with its CUDA backend.");
  m.def("cuda_device_count", &ikbo::cuda_device_count,
        "Usable CUDA devices (0 without CUDA support or without a GPU).");
  bind_candidate_map(m);
  bind_jagged_offsets(m);
  bind_lce(m);
  bind_baselines(m);
  bind_linear(m);
  bind_attention(m);
}
