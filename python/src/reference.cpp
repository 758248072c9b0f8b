// The CPU reference model (epcomm/reference.h), on numpy arrays: epcomm._epcomm.reference.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "arrays.h"
#include "bindings.h"
#include "epcomm/formats/reference_codecs.h"
#include "epcomm/reference.h"

namespace epcomm_py {

using namespace nb::literals;

namespace {

// ---- reference model ---------------------------------------------------------------------------

template <class T>
nb::ndarray<nb::numpy, T> to_numpy(std::vector<T> v, std::vector<size_t> shape) {
  auto* heap = new std::vector<T>(std::move(v));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T>(heap->data(), shape.size(), shape.data(), owner);
}

template <class T>
std::vector<std::remove_const_t<T>> from_numpy(const nb::ndarray<T, nb::device::cpu, nb::c_contig>& a) {
  return std::vector<std::remove_const_t<T>>(a.data(), a.data() + a.size());
}

nb::ndarray<nb::numpy, int32_t> src_info_to(const std::vector<epcomm::SrcInfo>& v) {
  std::vector<int32_t> raw(v.size() * 2);
  std::memcpy(raw.data(), v.data(), v.size() * sizeof(epcomm::SrcInfo));
  return to_numpy(std::move(raw), {v.size(), 2});
}

// Inputs are read only: read-only arrays (numpy views of JAX arrays, say) are taken as they are.
using U16 = nb::ndarray<const uint16_t, nb::device::cpu, nb::c_contig>;
using I32 = nb::ndarray<const int32_t, nb::device::cpu, nb::c_contig>;
using U8 = nb::ndarray<const uint8_t, nb::device::cpu, nb::c_contig>;

// A reference dispatch result's class with the properties both kinds have: row_offsets,
// expert_ids, src_info (numpy copies) and rows.
template <class Result>
nb::class_<Result> row_layout_class(nb::module_& r, const char* name) {
  return nb::class_<Result>(r, name)
      .def_prop_ro(
          "row_offsets",
          [](const Result& d) { return to_numpy(d.row_offsets, {d.row_offsets.size()}); },
          nb::rv_policy::move)
      .def_prop_ro(
          "expert_ids",
          [](const Result& d) { return to_numpy(d.expert_ids, {d.expert_ids.size()}); },
          nb::rv_policy::move)
      .def_prop_ro(
          "src_info", [](const Result& d) { return src_info_to(d.src_info); }, nb::rv_policy::move)
      .def_prop_ro("rows", &Result::rows);
}

// r.<name>(ref, out): '' when a combine output (bf16 bits) matches the reference's values (T),
// else the first difference, by `compare` (epcomm/reference.h).
template <class T>
void def_compare_combine(nb::module_& r, const char* name,
                         std::string (*compare)(const std::vector<T>&, const uint16_t*, int64_t)) {
  r.def(
      name,
      [compare](const nb::ndarray<const T, nb::device::cpu, nb::c_contig>& ref, const U16& out) {
        if (ref.size() != out.size()) return std::string("sizes differ");
        return compare(std::vector<T>(ref.data(), ref.data() + ref.size()), out.data(),
                       int64_t(out.size()));
      },
      "ref"_a.noconvert(), "out"_a.noconvert());
}

}  // namespace

void bind_reference(nb::module_& m) {
  nb::module_ r = m.def_submodule("reference", "The CPU reference model of dispatch and combine.");
  nb::class_<epcomm::reference::Problem>(r, "Problem",
                                         "Every rank's inputs (bf16 tokens as uint16 bits).")
      .def_ro("n_ranks", &epcomm::reference::Problem::n_ranks)
      .def_ro("hidden", &epcomm::reference::Problem::hidden)
      .def_ro("top_k", &epcomm::reference::Problem::top_k)
      .def_ro("n_experts", &epcomm::reference::Problem::n_experts)
      .def_rw("shared_expert", &epcomm::reference::Problem::shared_expert)
      .def_rw("skip_a2a", &epcomm::reference::Problem::skip_a2a)
      .def_rw("allreduce_world_size", &epcomm::reference::Problem::allreduce_world_size)
      .def("num_tokens",
           [](const epcomm::reference::Problem& p, int rank) {
             return epcomm::reference::rank_input(p, rank, "num_tokens").num_tokens;
           })
      .def("tokens",
           [](const epcomm::reference::Problem& p, int rank) {
             const auto& in = epcomm::reference::rank_input(p, rank, "tokens");
             return to_numpy(in.tokens, {size_t(in.num_tokens), size_t(p.hidden)});
           })
      .def("topk_ids",
           [](const epcomm::reference::Problem& p, int rank) {
             const auto& in = epcomm::reference::rank_input(p, rank, "topk_ids");
             return to_numpy(in.topk_ids, {size_t(in.num_tokens), size_t(p.top_k)});
           })
      .def("weights",
           [](const epcomm::reference::Problem& p, int rank) {
             const auto& in = epcomm::reference::rank_input(p, rank, "weights");
             return to_numpy(in.weights, {size_t(in.num_tokens), size_t(p.top_k)});
           })
      .def(
          "set_topk_ids",
          [](epcomm::reference::Problem& p, int rank, const I32& ids) {
            auto& in = epcomm::reference::rank_input(p, rank, "set_topk_ids");
            if (int64_t(ids.size()) != int64_t(in.num_tokens) * p.top_k)
              invalid("set_topk_ids: " + std::to_string(ids.size()) + " ids for " +
                      std::to_string(in.num_tokens) + " tokens x top_k " + std::to_string(p.top_k));
            in.topk_ids = from_numpy(ids);
          },
          "rank"_a, "ids"_a.noconvert());
  r.def(
      "make_problem",
      [](int n_ranks, int hidden, int top_k, int n_experts, std::vector<int32_t> num_tokens,
         uint64_t seed, double zipf_s, double mask_prob, bool replicated) {
        if (replicated) {
          if (num_tokens.size() != 1) invalid("make_problem: replicated takes one token count");
          return epcomm::reference::make_replicated_problem(n_ranks, hidden, top_k, n_experts,
                                                            num_tokens[0], seed, zipf_s, mask_prob);
        }
        return epcomm::reference::make_problem(n_ranks, hidden, top_k, n_experts, num_tokens, seed,
                                               zipf_s, mask_prob);
      },
      "n_ranks"_a, "hidden"_a, "top_k"_a, "n_experts"_a, "num_tokens"_a, "seed"_a, "zipf_s"_a = 0.0,
      "mask_prob"_a = 0.0, "replicated"_a = false);

  row_layout_class<epcomm::reference::DispatchResult>(r, "DispatchResult")
      .def_prop_ro(
          "tokens",
          [](const epcomm::reference::DispatchResult& d) {
            const size_t rows = d.src_info.size();
            return to_numpy(d.tokens, {rows, rows ? d.tokens.size() / rows : 0});
          },
          nb::rv_policy::move);
  row_layout_class<epcomm::reference::QuantDispatchResult>(r, "QuantDispatchResult")
      // The whole output shape (shape.rows rows): codes [rows, row_bytes], scales as raw bytes.
      .def_prop_ro(
          "codes",
          [](const epcomm::reference::QuantDispatchResult& d) {
            const size_t rows = size_t(d.out.shape.rows);
            return to_numpy(d.out.codes, {rows, rows ? d.out.codes.size() / rows : 0});
          },
          nb::rv_policy::move)
      .def_prop_ro(
          "scales",
          [](const epcomm::reference::QuantDispatchResult& d) {
            std::vector<uint8_t> raw(d.out.scales);
            if (!d.out.fp8_scales.empty()) {
              raw.resize(d.out.fp8_scales.size() * 4);
              std::memcpy(raw.data(), d.out.fp8_scales.data(), raw.size());
            }
            return to_numpy(std::move(raw), {raw.size()});
          },
          nb::rv_policy::move)
      .def_prop_ro(
          "scales_offsets",
          [](const epcomm::reference::QuantDispatchResult& d) {
            std::vector<int32_t> v(d.out.scales_offsets.begin(), d.out.scales_offsets.end());
            return to_numpy(std::move(v), {d.out.scales_offsets.size()});
          },
          nb::rv_policy::move)
      .def_prop_ro("out_rows",
                   [](const epcomm::reference::QuantDispatchResult& d) { return d.out.shape.rows; })
      .def_prop_ro(
          "row_bytes",
          [](const epcomm::reference::QuantDispatchResult& d) { return d.out.shape.row_bytes(); })
      .def("layout", [](const epcomm::reference::QuantDispatchResult& q) {
        // The rows as combine reads them (padding rows have rank -1 and are read by nobody).
        epcomm::reference::DispatchResult d;
        d.row_offsets = q.row_offsets;
        d.expert_ids = q.expert_ids;
        d.src_info = q.src_info;
        return d;
      });

  r.def("dispatch", &epcomm::reference::dispatch, "problem"_a, "rank"_a);
  r.def(
      "dispatch_quantized",
      [](const epcomm::reference::Problem& p, int rank, const std::string& format,
         float global_scale, int64_t max_routed_rows, bool fp8_pow2_scales) {
        return epcomm::reference::dispatch_quantized(
            p, rank, epcomm::reference::quant_format(parse_format(format)), global_scale,
            max_routed_rows, fp8_pow2_scales);
      },
      "problem"_a, "rank"_a, "format"_a, "global_scale"_a = 1.0f, "max_routed_rows"_a = -1,
      "fp8_pow2_scales"_a = false);
  r.def(
      "combine",
      [](const epcomm::reference::Problem& p,
         const std::vector<epcomm::reference::DispatchResult>& layouts,
         const std::vector<U16>& expert_out, int rank, bool weighted) {
        std::vector<std::vector<uint16_t>> y;
        for (const auto& a : expert_out)
          y.push_back(from_numpy(a));
        std::vector<double> v = epcomm::reference::combine(p, layouts, y, rank, weighted);
        const size_t T = size_t(epcomm::reference::rank_input(p, rank, "combine").num_tokens),
                     H = size_t(p.hidden);
        return weighted ? to_numpy(std::move(v), {T, H})
                        : to_numpy(std::move(v), {T, size_t(p.top_k), H});
      },
      "problem"_a, "layouts"_a, "expert_out"_a.noconvert(), "rank"_a, "weighted"_a);
  r.def(
      "combine_expert_side",
      [](const epcomm::reference::Problem& p,
         const std::vector<epcomm::reference::DispatchResult>& layouts,
         const std::vector<U16>& expert_out, int rank) {
        std::vector<std::vector<uint16_t>> y;
        for (const auto& a : expert_out)
          y.push_back(from_numpy(a));
        std::vector<float> v = epcomm::reference::combine_expert_side(p, layouts, y, rank);
        return to_numpy(
            std::move(v),
            {size_t(epcomm::reference::rank_input(p, rank, "combine_expert_side").num_tokens),
             size_t(p.hidden)});
      },
      "problem"_a, "layouts"_a, "expert_out"_a.noconvert(), "rank"_a);
  r.def(
      "compare_dispatch",
      [](const epcomm::reference::DispatchResult& ref, const I32& row_offsets,
         const I32& expert_ids, const I32& src_info, const U16& tokens, int hidden) {
        if (int64_t(row_offsets.size()) != int64_t(ref.row_offsets.size()))
          return std::string("row_offsets has ") + std::to_string(row_offsets.size()) +
                 " entries; the reference has " + std::to_string(ref.row_offsets.size());
        if (int64_t(src_info.size()) < 2 * ref.rows() ||
            int64_t(tokens.size()) < ref.rows() * hidden)
          return std::string("the outputs hold fewer rows than the reference's ") +
                 std::to_string(ref.rows());
        return epcomm::reference::compare_dispatch(
            ref, reinterpret_cast<const uint32_t*>(row_offsets.data()), expert_ids.data(),
            reinterpret_cast<const epcomm::SrcInfo*>(src_info.data()), tokens.data(), hidden);
      },
      "ref"_a, "row_offsets"_a.noconvert(), "expert_ids"_a.noconvert(), "src_info"_a.noconvert(),
      "tokens"_a.noconvert(), "hidden"_a,
      "'' when a dispatch output equals the reference, else the first difference.");
  r.def(
      "compare_dispatch_quantized",
      [](const epcomm::reference::QuantDispatchResult& ref, int64_t rows, int64_t row_bytes,
         const I32& row_offsets, const I32& expert_ids, const I32& src_info, const U8& codes,
         const U8& scales, const I32& scales_offsets) {
        epcomm::reference::QuantizedDispatchView v{};
        v.groups = int32_t(expert_ids.size());
        v.rows = rows;
        v.row_bytes = row_bytes;
        v.scales_bytes = int64_t(scales.size());
        v.num_scales_offsets = int32_t(scales_offsets.size());
        if (int64_t(row_offsets.size()) != v.groups + 1)
          return std::string("row_offsets must have len(expert_ids) + 1 entries");
        if (int64_t(src_info.size()) < 2 * ref.rows() ||
            int64_t(codes.size()) < ref.rows() * row_bytes)
          return std::string("the outputs hold fewer rows than the reference's ") +
                 std::to_string(ref.rows());
        v.row_offsets = reinterpret_cast<const uint32_t*>(row_offsets.data());
        v.expert_ids = expert_ids.data();
        v.src_info = reinterpret_cast<const epcomm::SrcInfo*>(src_info.data());
        v.codes = codes.data();
        v.scales = scales.data();
        v.scales_offsets = reinterpret_cast<const uint32_t*>(scales_offsets.data());
        return epcomm::reference::compare_dispatch_quantized(ref, v);
      },
      "ref"_a, "rows"_a, "row_bytes"_a, "row_offsets"_a.noconvert(), "expert_ids"_a.noconvert(),
      "src_info"_a.noconvert(), "codes"_a.noconvert(), "scales"_a.noconvert(),
      "scales_offsets"_a.noconvert(),
      "'' when a quantised dispatch output equals the reference bit for bit, else the first "
      "difference (scales as raw bytes).");
  def_compare_combine(r, "compare_combine_bf16", &epcomm::reference::compare_combine_bf16);
  def_compare_combine(r, "compare_combine_expert_side",
                      &epcomm::reference::compare_combine_expert_side);
  def_compare_combine(r, "compare_exact_bf16", &epcomm::reference::compare_exact_bf16);
}

}  // namespace epcomm_py
