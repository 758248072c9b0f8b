// The padded per-expert layout (epcomm/padded_layout.h) and the SiLU kernels (epcomm/silu.h).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>

#include <optional>
#include <string>
#include <utility>

#include "arrays.h"
#include "bindings.h"
#include "epcomm/formats/scale_layouts.h"
#include "epcomm/padded_layout.h"
#include "epcomm/routing_layout.h"
#include "epcomm/silu.h"

namespace epcomm_py {

using namespace nb::literals;

namespace {

// Checks a launch's arguments (sizes, addresses) before any CUDA call, then launches it on
// `device`.
template <class Args>
void checked_launch(int32_t device, const Args& a, void (*check)(const Args&),
                    void (*launch)(const Args&, cudaStream_t), uintptr_t stream) {
  check(a);
  DeviceGuard guard;
  cuda_check(cudaSetDevice(device), "cudaSetDevice");
  launch(a, as_stream(stream));
}

// ---- SiLU --------------------------------------------------------------------------------------

epcomm::SiluInput silu_input(const Ctx& c, const Array& x, const Array& row_offsets,
                             int32_t intermediate, const std::optional<Array>& src_info) {
  if (intermediate <= 0) invalid(c.op + ": x must have a positive, even number of columns");
  check_array(c, "x", x, Elem::kBf16, {-1, 2 * int64_t(intermediate)}, "[rows, 2 * I]");
  if (row_offsets.ndim() != 1 || row_offsets.shape(0) < 2)
    invalid(c.op + ": row_offsets must have shape [G + 1] with G >= 1; got " +
            shape_str(row_offsets));
  check_array(c, "row_offsets", row_offsets, Elem::kI32, {-1}, "[G + 1]");
  epcomm::SiluInput in;
  in.x = x.data();
  in.row_offsets = static_cast<const uint32_t*>(row_offsets.data());
  in.groups = int32_t(row_offsets.shape(0) - 1);
  in.intermediate = intermediate;
  in.max_rows = int64_t(x.shape(0));
  if (src_info) {
    check_array(c, "src_info", *src_info, Elem::kI32, {in.max_rows, 2},
                "[rows, 2] (the dispatch's)");
    in.src_info = static_cast<const epcomm::SrcInfo*>(src_info->data());
  }
  return in;
}

Ctx silu_ctx(const char* op, const Array& x) {
  return Ctx{std::string("epcomm ") + op,
             x.device_type() == nb::device::cuda::value ? int(x.device_id()) : 0};
}

// ---- the padded per-expert layout -------------------------------------------------------------

// The rows of a dispatch output: row_offsets int32 [G + 1], src_info int32 [max_rows, 2].
epcomm::DispatchRows dispatch_rows(const Ctx& c, const Array& row_offsets, const Array& src_info) {
  check_array(c, "row_offsets", row_offsets, Elem::kI32, {-1}, "[G + 1]");
  check_array(c, "src_info", src_info, Elem::kI32, {-1, 2}, "[max_rows, 2]");
  if (row_offsets.shape(0) < 2) invalid(c.op + ": row_offsets needs at least 2 entries");
  epcomm::DispatchRows r;
  r.row_offsets = static_cast<const uint32_t*>(row_offsets.data());
  r.src_info = static_cast<const epcomm::SrcInfo*>(src_info.data());
  r.groups = int32_t(row_offsets.shape(0) - 1);
  r.max_rows = int64_t(src_info.shape(0));
  return r;
}

// Bytes a row of a contiguous CUDA array whose first `lead` dimensions hold `rows` rows.
int64_t row_bytes_of(const Ctx& c, const char* name, const Array& a, int64_t rows, size_t lead) {
  const std::string who = c.op + ": " + name;
  check_out(c, name, a, 0);  // contiguous CUDA memory on the call's device
  if (a.ndim() <= lead) invalid(who + " has shape " + shape_str(a) + ": it needs rows of values");
  int64_t lead_rows = 1;
  for (size_t i = 0; i < lead; ++i) lead_rows *= int64_t(a.shape(i));
  if (lead_rows != rows)
    invalid(who + " has shape " + shape_str(a) + "; it needs " + std::to_string(rows) + " rows");
  return rows ? int64_t(a.nbytes()) / rows : 0;
}

// capacity of a padded [G, capacity, ...] array.
int64_t padded_capacity(const Ctx& c, const char* name, const Array& a, int64_t groups) {
  if (a.ndim() < 3 || int64_t(a.shape(0)) != groups)
    invalid(c.op + ": " + name + " must have shape [G = " + std::to_string(groups) +
            ", capacity, ...]; got " + shape_str(a));
  return int64_t(a.shape(1));
}

}  // namespace

void bind_silu(nb::module_& m) {
  // SiLU kernels (epcomm/silu.h). Outputs are given by the caller.
  m.def(
      "pad_expert_rows",
      [](const Array& codes, const std::optional<Array>& scales, const Array& row_offsets,
         const Array& src_info, int32_t n_ranks, const Array& padded_codes,
         const std::optional<Array>& padded_scales, const std::optional<Array>& padded_ue8m0,
         const Array& counts, const std::optional<Array>& src_token,
         const std::optional<Array>& layout_range, uintptr_t stream) {
        const Ctx c{"epcomm pad_expert_rows", codes.device_id()};
        epcomm::PadExpertRows a;
        a.rows = dispatch_rows(c, row_offsets, src_info);
        a.row_bytes = row_bytes_of(c, "codes", codes, a.rows.max_rows, 1);
        const int64_t G = a.rows.groups;
        a.capacity = padded_capacity(c, "padded_codes", padded_codes, G);
        if (row_bytes_of(c, "padded_codes", padded_codes, G * a.capacity, 2) != a.row_bytes)
          invalid(c.op + ": padded_codes rows are not codes rows: " + shape_str(padded_codes) +
                  " against " + shape_str(codes));
        a.codes = codes.data();
        a.padded_codes = padded_codes.data();
        if (bool(scales) != (padded_scales || padded_ue8m0))
          invalid(c.op +
                  ": give scales with padded_scales or padded_ue8m0 (or both), or none "
                  "of them");
        if (scales) {
          check_array(c, "scales", *scales, Elem::kF32, {-1, a.rows.max_rows},
                      "[H / 128, max_rows] (the dispatch output's)");
          a.scale_cols = int32_t(scales->shape(0));
          a.scales = static_cast<const float*>(scales->data());
          if (padded_scales) {
            check_array(c, "padded_scales", *padded_scales, Elem::kF32,
                        {G, a.scale_cols, a.capacity}, "[G, H / 128, capacity]");
            a.padded_scales = static_cast<float*>(padded_scales->data());
          }
          if (padded_ue8m0) {
            if (a.scale_cols % 4 != 0)
              invalid(c.op + ": padded_ue8m0 needs a multiple of 4 scales a row; got " +
                      std::to_string(a.scale_cols));
            check_array(c, "padded_ue8m0", *padded_ue8m0, Elem::kI32,
                        {G, a.scale_cols / 4, a.capacity}, "[G, H / 512, capacity]");
            a.padded_ue8m0 = static_cast<uint32_t*>(padded_ue8m0->data());
          }
        }
        check_array(c, "counts", counts, Elem::kI32, {G}, "[G]");
        a.counts = static_cast<int32_t*>(counts.data());
        if (src_token) {
          check_array(c, "src_token", *src_token, Elem::kI32, {G, a.capacity}, "[G, capacity]");
          a.src_token = static_cast<int32_t*>(src_token->data());
        }
        if (layout_range) {
          check_array(c, "layout_range", *layout_range, Elem::kI64, {G, n_ranks},
                      "[G, n_ranks]");
          a.layout_range = static_cast<int64_t*>(layout_range->data());
        }
        a.n_ranks = n_ranks;
        DeviceGuard guard;
        cuda_check(cudaSetDevice(c.device), "cudaSetDevice");
        epcomm::pad_expert_rows(a, as_stream(stream));
      },
      "codes"_a, "scales"_a.none(), "row_offsets"_a, "src_info"_a, "n_ranks"_a, "padded_codes"_a,
      "padded_scales"_a.none(), "padded_ue8m0"_a.none(), "counts"_a, "src_token"_a.none(),
      "layout_range"_a.none(), "stream"_a,
      "Copies a dispatch output into the padded per-expert layout (epcomm/padded_layout.h).");
  m.def(
      "unpad_expert_rows",
      [](const Array& padded, const Array& row_offsets, const Array& src_info, const Array& out,
         uintptr_t stream) {
        const Ctx c{"epcomm unpad_expert_rows", padded.device_id()};
        epcomm::UnpadExpertRows a;
        a.rows = dispatch_rows(c, row_offsets, src_info);
        const int64_t G = a.rows.groups;
        a.capacity = padded_capacity(c, "padded", padded, G);
        a.row_bytes = row_bytes_of(c, "padded", padded, G * a.capacity, 2);
        if (row_bytes_of(c, "out", out, a.rows.max_rows, 1) != a.row_bytes)
          invalid(c.op + ": out rows are not padded rows: " + shape_str(out) + " against " +
                  shape_str(padded));
        a.padded = padded.data();
        a.out = out.data();
        DeviceGuard guard;
        cuda_check(cudaSetDevice(c.device), "cudaSetDevice");
        epcomm::unpad_expert_rows(a, as_stream(stream));
      },
      "padded"_a, "row_offsets"_a, "src_info"_a, "out"_a, "stream"_a,
      "Brings padded per-expert rows back to dispatch row order (epcomm/padded_layout.h).");
  // The DeepEP layer's routing launches (python/epcomm/deep_ep.py), device addresses as integers
  // (0: none). The layer has checked every tensor's dtype, shape, device and contiguity before
  // it calls; converting its tensors through DLPack cost more host time than the launches (ten
  // tensors a prefill dispatch). The library checks the sizes and each address (null,
  // alignment) before any CUDA call.
  m.def(
      "routing_layout",
      [](uintptr_t topk_ids, int32_t id_bytes, int64_t num_tokens, int32_t top_k,
         int32_t num_experts, int32_t n_ranks, uintptr_t tokens_per_rank,
         uintptr_t tokens_per_expert, uintptr_t token_in_rank, int32_t device, uintptr_t stream) {
        epcomm::RoutingLayout a;
        a.topk_ids = reinterpret_cast<const void*>(topk_ids);
        a.id_bytes = id_bytes;
        a.num_tokens = num_tokens;
        a.top_k = a.ids_stride = top_k;
        a.num_experts = num_experts;
        a.n_ranks = n_ranks;
        a.tokens_per_rank = reinterpret_cast<int32_t*>(tokens_per_rank);
        a.tokens_per_expert = reinterpret_cast<int32_t*>(tokens_per_expert);
        a.token_in_rank = reinterpret_cast<bool*>(token_in_rank);
        checked_launch(device, a, epcomm::check_routing_layout, epcomm::routing_layout, stream);
      },
      "topk_ids"_a, "id_bytes"_a, "num_tokens"_a, "top_k"_a, "num_experts"_a, "n_ranks"_a,
      "tokens_per_rank"_a, "tokens_per_expert"_a, "token_in_rank"_a, "device"_a, "stream"_a,
      "Tokens per rank and per expert, and whether each token goes to each rank, from top-k ids "
      "[num_tokens, top_k] (device addresses; epcomm/routing_layout.h).");
  m.def(
      "routing_layout_of_mask",
      [](uintptr_t token_in_rank, int64_t num_tokens, int32_t n_ranks, uintptr_t tokens_per_rank,
         uintptr_t rank_ids, int32_t device, uintptr_t stream) {
        epcomm::RoutingLayout a;
        a.rank_mask = reinterpret_cast<const bool*>(token_in_rank);
        a.num_tokens = num_tokens;
        a.n_ranks = a.num_experts = n_ranks;
        a.top_k = a.ids_stride = 0;
        a.tokens_per_rank = reinterpret_cast<int32_t*>(tokens_per_rank);
        a.rank_ids = reinterpret_cast<int32_t*>(rank_ids);
        checked_launch(device, a, epcomm::check_routing_layout, epcomm::routing_layout, stream);
      },
      "token_in_rank"_a, "num_tokens"_a, "n_ranks"_a, "tokens_per_rank"_a, "rank_ids"_a, "device"_a,
      "stream"_a,
      "The rank ids (r where token t goes to rank r, else -1) and tokens per rank of a routing "
      "given as a [num_tokens, n_ranks] bool mask (device addresses; epcomm/routing_layout.h).");
  m.def(
      "received_topk",
      [](uintptr_t ids, uintptr_t weights, int64_t row_bytes, uintptr_t num_rows, int32_t top_k,
         int64_t first_expert, uintptr_t local_ids, uintptr_t local_weights, int64_t max_rows,
         uintptr_t counts, int32_t n_local, int32_t device, uintptr_t stream) {
        // ids and weights are strided views of a dispatch output: the caller keeps max_rows
        // within the rows they hold.
        epcomm::ReceivedTopk a;
        a.ids = reinterpret_cast<const int64_t*>(ids);
        a.weights = reinterpret_cast<const float*>(weights);
        a.row_bytes = row_bytes;
        a.max_rows = max_rows;
        a.num_rows = reinterpret_cast<const uint32_t*>(num_rows);
        a.top_k = top_k;
        a.first_expert = first_expert;
        a.n_local = n_local;
        a.local_ids = reinterpret_cast<int64_t*>(local_ids);
        a.local_weights = reinterpret_cast<float*>(local_weights);
        a.counts = reinterpret_cast<int32_t*>(counts);
        checked_launch(device, a, epcomm::check_received_topk, epcomm::received_topk, stream);
      },
      "ids"_a, "weights"_a, "row_bytes"_a, "num_rows"_a, "top_k"_a, "first_expert"_a, "local_ids"_a,
      "local_weights"_a, "max_rows"_a, "counts"_a, "n_local"_a, "device"_a, "stream"_a,
      "A dispatch over ranks' received top-k (device addresses ids and weights, rows of "
      "row_bytes; num_rows the device word of rows received) as this rank's local expert ids and "
      "weights, and counts = [rows, slots per local expert] (epcomm/routing_layout.h).");
  m.def(
      "silu_bf16",
      [](const Array& x, const Array& row_offsets, int32_t intermediate, const Array& out,
         uintptr_t stream) {
        const Ctx c = silu_ctx("silu_bf16", x);
        const epcomm::SiluInput in = silu_input(c, x, row_offsets, intermediate, std::nullopt);
        check_array(c, "out", out, Elem::kBf16, {in.max_rows, intermediate}, "[rows, I]");
        DeviceGuard guard;
        cuda_check(cudaSetDevice(c.device), "cudaSetDevice");
        epcomm::silu_bf16(in, out.data(), as_stream(stream));
      },
      "x"_a, "row_offsets"_a, "intermediate"_a, "out"_a, "stream"_a);
  m.def(
      "silu_fp8",
      [](const Array& x, const Array& row_offsets, int32_t intermediate,
         const std::optional<Array>& src_info, const Array& codes, const Array& scales,
         uintptr_t stream) {
        const Ctx c = silu_ctx("silu_fp8", x);
        const epcomm::SiluInput in = silu_input(c, x, row_offsets, intermediate, src_info);
        check_array(c, "codes", codes, Elem::kBytes, {in.max_rows, intermediate}, "[rows, I]");
        check_array(c, "scales", scales, Elem::kF32, {intermediate / 128, in.max_rows},
                    "[I / 128, rows]");
        DeviceGuard guard;
        cuda_check(cudaSetDevice(c.device), "cudaSetDevice");
        epcomm::silu_fp8(in,
                         {static_cast<uint8_t*>(codes.data()), static_cast<float*>(scales.data())},
                         as_stream(stream));
      },
      "x"_a, "row_offsets"_a, "intermediate"_a, "src_info"_a.none(), "codes"_a, "scales"_a,
      "stream"_a);
  m.def(
      "silu_nvfp4",
      [](const Array& x, const Array& row_offsets, int32_t intermediate, const Array& codes,
         const Array& scales, const Array& scales_offsets, const Array& global_scales,
         bool interleaved, uintptr_t stream) {
        const Ctx c = silu_ctx("silu_nvfp4", x);
        const epcomm::SiluInput in = silu_input(c, x, row_offsets, intermediate, std::nullopt);
        check_array(c, "codes", codes, Elem::kBytes, {in.max_rows, intermediate / 2},
                    "[rows, I / 2]");
        const int64_t sb =
            epcomm::SwizzledScaleLayout::make(intermediate, 16, in.max_rows, in.groups).size();
        check_array(c, "scales", scales, Elem::kBytes, {sb},
                    "[SwizzledScaleLayout::make(I, 16, rows, G).size()]");
        check_array(c, "scales_offsets", scales_offsets, Elem::kI32, {in.groups}, "[G]");
        check_array(c, "global_scales", global_scales, Elem::kF32, {in.groups}, "[G]");
        DeviceGuard guard;
        cuda_check(cudaSetDevice(c.device), "cudaSetDevice");
        epcomm::silu_nvfp4(
            in,
            {static_cast<uint8_t*>(codes.data()), static_cast<uint8_t*>(scales.data()),
             static_cast<uint32_t*>(scales_offsets.data())},
            static_cast<const float*>(global_scales.data()), interleaved, as_stream(stream));
      },
      "x"_a, "row_offsets"_a, "intermediate"_a, "codes"_a, "scales"_a, "scales_offsets"_a,
      "global_scales"_a, "interleaved"_a, "stream"_a);
  m.def(
      "silu_mxfp4",
      [](const Array& x, const Array& row_offsets, int32_t intermediate, const Array& codes,
         const Array& scales, std::optional<std::pair<float, float>> clamp, uintptr_t stream) {
        const Ctx c = silu_ctx("silu_mxfp4", x);
        const epcomm::SiluInput in = silu_input(c, x, row_offsets, intermediate, std::nullopt);
        check_array(c, "codes", codes, Elem::kBytes, {in.max_rows, intermediate / 2},
                    "[rows, I / 2]");
        check_array(c, "scales", scales, Elem::kBytes, {in.max_rows, intermediate / 32},
                    "[rows, I / 32]");
        epcomm::SwigluClamp cl{};
        if (clamp) cl = epcomm::SwigluClamp{clamp->first, clamp->second};
        DeviceGuard guard;
        cuda_check(cudaSetDevice(c.device), "cudaSetDevice");
        epcomm::silu_mxfp4(
            in, {static_cast<uint8_t*>(codes.data()), static_cast<uint8_t*>(scales.data())},
            clamp ? &cl : nullptr, as_stream(stream));
      },
      "x"_a, "row_offsets"_a, "intermediate"_a, "codes"_a, "scales"_a, "clamp"_a.none(),
      "stream"_a);
  m.def(
      "nvfp4_scales_bytes",
      [](int32_t intermediate, int64_t rows, int32_t groups) {
        return epcomm::SwizzledScaleLayout::make(intermediate, 16, rows, groups).size();
      },
      "intermediate"_a, "rows"_a, "groups"_a,
      "Bytes of silu_nvfp4's swizzled scale array for rows and G groups.");
}

}  // namespace epcomm_py
