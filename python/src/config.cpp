// The limits, Sizes and Config.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <type_traits>
#include <vector>

#include "arrays.h"
#include "bindings.h"
#include "epcomm/config.h"
#include "epcomm/layout.h"
#include "epcomm/routing_layout.h"
#include "epcomm/tensors.h"

namespace epcomm_py {

using namespace nb::literals;

epcomm::TokenFormat parse_format(const std::string& name) {
  if (auto f = epcomm::token_format_from_name(name)) return *f;
  invalid("epcomm config: format = '" + name + "' is invalid: one of " +
          epcomm::token_format_names());
}

epcomm::DispatchPath parse_path(const std::string& name) {
  if (auto p = epcomm::dispatch_path_from_name(name)) return *p;
  invalid("epcomm config: dispatch_path = '" + name + "' is invalid: one of " +
          epcomm::dispatch_path_names());
}

namespace {
nb::tuple as_tuple(const std::vector<int64_t>& v) {
  nb::list l;
  for (int64_t x : v) l.append(x);
  return nb::steal<nb::tuple>(PyList_AsTuple(l.ptr()));
}
}  // namespace

void bind_config(nb::module_& m) {
  m.attr("MAX_TOP_K") = epcomm::kMaxTopK;
  m.attr("MAX_EXPERTS") = epcomm::kMaxExperts;
  m.attr("MAX_RANKS") = epcomm::kMaxRanks;
  m.attr("LOW_LATENCY_MAX_TOKENS") = epcomm::kLowLatencyMaxTokens;
  m.attr("LOW_LATENCY_MIN_SMS") = epcomm::kLowLatencyMinSms;
  m.attr("SHARED_EXPERT_ID") = epcomm::kSharedExpertId;
  m.attr("ROUTING_MAX_TOP_K") = epcomm::kRoutingMaxTopK;
  m.attr("ROUTING_MAX_COUNTERS") = epcomm::kRoutingMaxCounters;
  {
    std::vector<std::string> formats;
    for (int32_t f = 0; f < epcomm::kNumTokenFormats; ++f)
      formats.push_back(epcomm::token_format_name(epcomm::TokenFormat(f)));
    m.attr("FORMATS") = formats;
  }

  nb::class_<epcomm::Sizes>(m, "Sizes", "What a caller needs to allocate a group's outputs.")
      .def_ro("n_ranks", &epcomm::Sizes::n_ranks)
      .def_ro("n_local_experts", &epcomm::Sizes::n_local_experts)
      .def_ro("num_groups", &epcomm::Sizes::num_groups)
      .def_ro("max_routed_rows", &epcomm::Sizes::max_routed_rows)
      .def_ro("max_recv_rows", &epcomm::Sizes::max_recv_rows)
      .def_ro("token_bytes", &epcomm::Sizes::token_bytes)
      .def_ro("scales_bytes", &epcomm::Sizes::scales_bytes)
      .def_ro("num_scales_offsets", &epcomm::Sizes::num_scales_offsets);

  // Config's properties, one per entry of epcomm::kConfigFields (formats and dispatch paths by
  // name), and their names, which make_config takes.
  nb::class_<epcomm::Config> config(m, "Config", "A group's configuration (epcomm/config.h).");
  config.def(nb::init<>());
  std::vector<std::string> field_names;
  epcomm::for_each_config_field([&](const auto& field) {
    using T = std::decay_t<decltype(epcomm::Config().*field.member)>;
    const auto member = field.member;
    field_names.push_back(field.name);
    if constexpr (std::is_same_v<T, epcomm::TokenFormat>)
      config.def_prop_rw(
          field.name,
          [member](const epcomm::Config& c) {
            return std::string(epcomm::token_format_name(c.*member));
          },
          [member](epcomm::Config& c, const std::string& v) { c.*member = parse_format(v); });
    else if constexpr (std::is_same_v<T, epcomm::DispatchPath>)
      config.def_prop_rw(
          field.name,
          [member](const epcomm::Config& c) {
            return std::string(epcomm::dispatch_path_name(c.*member));
          },
          [member](epcomm::Config& c, const std::string& v) { c.*member = parse_path(v); });
    else
      config.def_rw(field.name, member);
  });
  m.attr("CONFIG_FIELDS") = field_names;
  config
      .def("validate", &epcomm::Config::validate, "n_ranks"_a,
           "Raises InvalidArgument naming the first bad field for a group of n_ranks.")
      .def(
          "sizes",
          [](const epcomm::Config& c, int n) {
            c.validate(n);
            return epcomm::compute_sizes(c, n);
          },
          "n_ranks"_a, "The output sizes of a group of n_ranks with this configuration.");

  // The tensors a caller allocates (epcomm/tensors.h); dtype by PyTorch's name.
  nb::class_<epcomm::TensorDesc>(m, "TensorDesc",
                                 "A tensor's name, dtype, shape and strides (epcomm/tensors.h).")
      .def_prop_ro("name", [](const epcomm::TensorDesc& d) { return std::string(d.name); })
      .def_prop_ro(
          "dtype",
          [](const epcomm::TensorDesc& d) { return std::string(epcomm::dtype_name(d.dtype)); })
      .def_prop_ro("shape", [](const epcomm::TensorDesc& d) { return as_tuple(d.shape); })
      .def_prop_ro("strides", [](const epcomm::TensorDesc& d) { return as_tuple(d.strides); })
      .def_prop_ro("numel", &epcomm::TensorDesc::numel)
      .def_prop_ro("bytes", &epcomm::TensorDesc::bytes)
      .def("__repr__", [](const epcomm::TensorDesc& d) {
        std::string shape;
        for (int64_t x : d.shape)
          shape += (shape.empty() ? "" : ", ") + std::to_string(x);
        return "TensorDesc(" + std::string(d.name) + ", " + epcomm::dtype_name(d.dtype) + ", [" +
               shape + "])";
      });
  m.def("dispatch_output_descs", &epcomm::dispatch_output_descs, "config"_a, "sizes"_a,
        "The dispatch outputs of a group with this config and sizes: tokens, row_offsets, "
        "expert_ids, src_info, scales, scales_offsets (shape [0] where the format has none).");
  m.def("combine_output_desc", &epcomm::combine_output_desc, "config"_a, "num_tokens"_a,
        "reduced"_a, "hidden"_a = 0,
        "The combine output: [T, H] bf16 reduced, else [T, top_k, H]; H = hidden where given "
        "(a combine of fewer columns), else the config's.");
  m.def("expert_out_desc", &epcomm::expert_out_desc, "config"_a, "sizes"_a,
        "What combine reads on the expert side: [max_recv_rows, H] bf16.");
}

}  // namespace epcomm_py
