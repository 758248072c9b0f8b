// The limits, Sizes and Config.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "arrays.h"
#include "bindings.h"
#include "epcomm/config.h"
#include "epcomm/layout.h"

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

void bind_config(nb::module_& m) {
  m.attr("MAX_TOP_K") = epcomm::kMaxTopK;
  m.attr("MAX_EXPERTS") = epcomm::kMaxExperts;
  m.attr("MAX_RANKS") = epcomm::kMaxRanks;
  m.attr("LOW_LATENCY_MAX_TOKENS") = epcomm::kLowLatencyMaxTokens;
  m.attr("SHARED_EXPERT_ID") = epcomm::kSharedExpertId;
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

  nb::class_<epcomm::Config>(m, "Config", "A group's configuration (epcomm/config.h).")
      .def(nb::init<>())
      .def_rw("hidden", &epcomm::Config::hidden)
      .def_rw("top_k", &epcomm::Config::top_k)
      .def_rw("n_experts", &epcomm::Config::n_experts)
      .def_rw("max_tokens_per_rank", &epcomm::Config::max_tokens_per_rank)
      .def_prop_rw(
          "format",
          [](const epcomm::Config& c) { return std::string(epcomm::token_format_name(c.format)); },
          [](epcomm::Config& c, const std::string& v) { c.format = parse_format(v); })
      .def_rw("nvfp4_global_scale", &epcomm::Config::nvfp4_global_scale)
      .def_rw("num_sms", &epcomm::Config::num_sms)
      .def_rw("timeout_seconds", &epcomm::Config::timeout_seconds)
      .def_rw("trace", &epcomm::Config::trace)
      .def_rw("share_gpus", &epcomm::Config::share_gpus)
      .def_rw("max_recv_rows", &epcomm::Config::max_recv_rows)
      .def_prop_rw(
          "dispatch_path",
          [](const epcomm::Config& c) {
            return std::string(epcomm::dispatch_path_name(c.dispatch_path));
          },
          [](epcomm::Config& c, const std::string& v) { c.dispatch_path = parse_path(v); })
      .def_rw("shared_expert", &epcomm::Config::shared_expert)
      .def_rw("skip_a2a", &epcomm::Config::skip_a2a)
      .def_rw("allreduce_world_size", &epcomm::Config::allreduce_world_size)
      .def_rw("ranks_per_node", &epcomm::Config::ranks_per_node)
      .def("validate", &epcomm::Config::validate, "n_ranks"_a,
           "Raises InvalidArgument naming the first bad field for a group of n_ranks.")
      .def(
          "sizes",
          [](const epcomm::Config& c, int n) {
            c.validate(n);
            return epcomm::compute_sizes(c, n);
          },
          "n_ranks"_a, "The output sizes of a group of n_ranks with this configuration.");
}

}  // namespace epcomm_py
