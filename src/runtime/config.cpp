#include "epcomm/config.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <locale>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

#include "epcomm/error.h"
#include "epcomm/formats/scale_layouts.h"
#include "epcomm/layout.h"
#include "epcomm/trace.h"

namespace epcomm {

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kOk: return "ok";
    case ErrorCode::kInvalidArgument: return "invalid argument";
    case ErrorCode::kConfigMismatch: return "config mismatch";
    case ErrorCode::kSetup: return "setup";
    case ErrorCode::kCuda: return "CUDA error";
    case ErrorCode::kTimeout: return "timeout";
    case ErrorCode::kBadExpertId: return "bad expert id";
    case ErrorCode::kDuplicateExpert: return "duplicate expert";
    case ErrorCode::kPoisoned: return "group poisoned";
    case ErrorCode::kBootstrap: return "bootstrap";
    case ErrorCode::kRecvCapacity: return "receive capacity exceeded";
    case ErrorCode::kBadPeerData: return "bad data from a peer";
  }
  return "unknown";
}

const char* trace_mark_name(TraceMark m) {
  switch (m) {
    case kTraceStart: return "start";
    case kTraceRanked: return "ranked";
    case kTraceRouted: return "routed";
    case kTraceAcked: return "acked";
    case kTraceMetaSent:
      return "meta sent";
    case kTraceStored:
      return "stored";
    case kTraceFenced:
      return "fenced";
    case kTraceSent: return "sent";
    case kTraceRecvStart: return "recv start";
    case kTraceCountsIn:
      return "counts in";
    case kTraceChecked:
      return "checked";
    case kTraceReady: return "ready";
    case kTraceDone: return "done";
    case kTraceMarks: break;
  }
  return "unknown";
}

const char* token_format_name(TokenFormat f) {
  switch (f) {
    case TokenFormat::kBF16: return "bf16";
    case TokenFormat::kFp8Blockwise: return "fp8-blockwise";
    case TokenFormat::kNvfp4: return "nvfp4";
    case TokenFormat::kMxfp8: return "mxfp8";
    case TokenFormat::kMxfp4: return "mxfp4";
  }
  return "unknown";
}

const char* dispatch_path_name(DispatchPath p) {
  switch (p) {
    case DispatchPath::kAuto:
      return "auto";
    case DispatchPath::kThroughput:
      return "throughput";
    case DispatchPath::kLowLatency:
      return "low-latency";
  }
  return "unknown";
}

namespace {

// The enum value in [0, n) whose name is `name`, or -1; and every name, quoted.
template <typename E>
int32_t find_name(const std::string& name, int32_t n, const char* (*name_of)(E)) {
  for (int32_t v = 0; v < n; ++v)
    if (name == name_of(E(v))) return v;
  return -1;
}
template <typename E>
std::string all_names(int32_t n, const char* (*name_of)(E)) {
  std::string out;
  for (int32_t v = 0; v < n; ++v) out += std::string(v ? ", '" : "'") + name_of(E(v)) + "'";
  return out;
}

}  // namespace

std::optional<TokenFormat> token_format_from_name(const std::string& name) {
  const int32_t v = find_name(name, kNumTokenFormats, &token_format_name);
  return v < 0 ? std::nullopt : std::optional<TokenFormat>(TokenFormat(v));
}
std::string token_format_names() { return all_names(kNumTokenFormats, &token_format_name); }

std::optional<DispatchPath> dispatch_path_from_name(const std::string& name) {
  const int32_t v = find_name(name, kNumDispatchPaths, &dispatch_path_name);
  return v < 0 ? std::nullopt : std::optional<DispatchPath>(DispatchPath(v));
}
std::string dispatch_path_names() { return all_names(kNumDispatchPaths, &dispatch_path_name); }

namespace {
void require(bool ok, const std::string& field, const std::string& rule, long long value) {
  if (!ok) {
    std::ostringstream os;
    os << "epcomm config: " << field << " = " << value << " is invalid: " << rule;
    throw Error(ErrorCode::kInvalidArgument, os.str());
  }
}
}  // namespace

double default_timeout_seconds() {
  const char* env = std::getenv("EPCOMM_TIMEOUT_SECONDS");
  if (env == nullptr || *env == '\0') return kDefaultTimeoutSeconds;
  // A plain decimal number of seconds, spaces around it allowed; anything else (hex, "inf",
  // trailing text) is NaN, which validation reports naming the variable.
  std::istringstream in(env);
  in.imbue(std::locale::classic());
  double v = 0;
  std::string rest;
  const std::string text(env);
  const bool plain = text.find_first_not_of("0123456789.eE+- \t") == std::string::npos;
  if (!plain || !(in >> v) || (in >> rest) || !std::isfinite(v)) return std::nan("");
  return v;
}

void Config::validate(int n_ranks) const {
  // Every message names the field as kConfigFields does.
  auto name = [](auto member) { return config_field_name(member); };
  require(n_ranks >= 1 && n_ranks <= kMaxRanks, "n_ranks",
          "between 1 and " + std::to_string(kMaxRanks), n_ranks);
  require(int32_t(format) >= 0 && int32_t(format) < kNumTokenFormats, name(&Config::format),
          "one of TokenFormat's values", int(format));
  const int32_t multiple = format_hidden_multiple(format);
  require(hidden > 0 && hidden % multiple == 0, name(&Config::hidden),
          std::string("a positive multiple of ") + std::to_string(multiple) + " (" +
              token_format_name(format) + ")",
          hidden);
  require(top_k >= 1 && top_k <= kMaxTopK, name(&Config::top_k), "between 1 and 16", top_k);
  require(n_experts >= 1 && n_experts <= kMaxExperts, name(&Config::n_experts),
          "between 1 and 1024", n_experts);
  require(n_experts % n_ranks == 0, name(&Config::n_experts),
          "a multiple of n_ranks = " + std::to_string(n_ranks), n_experts);
  require(max_tokens_per_rank >= 1 && max_tokens_per_rank <= (1 << 20),
          name(&Config::max_tokens_per_rank), "between 1 and 2^20", max_tokens_per_rank);
  if (format == TokenFormat::kNvfp4 &&
      !(nvfp4_global_scale > 0.0f && std::isfinite(nvfp4_global_scale)))
    throw Error(ErrorCode::kInvalidArgument,
                "epcomm config: " + std::string(name(&Config::nvfp4_global_scale)) + " = " +
                    std::to_string(nvfp4_global_scale) + " is invalid: a positive finite number");
  if (fp8_pow2_scales && format != TokenFormat::kFp8Blockwise)
    throw Error(ErrorCode::kInvalidArgument,
                "epcomm config: " + std::string(name(&Config::fp8_pow2_scales)) +
                    " = true needs format fp8-blockwise (the format is " +
                    token_format_name(format) + ")");
  require(num_sms >= 1 && num_sms <= 1024, name(&Config::num_sms), "between 1 and 1024", num_sms);
  if (!(timeout_seconds > 0 && timeout_seconds <= kMaxTimeoutSeconds)) {
    std::ostringstream os;
    os << "epcomm config: " << name(&Config::timeout_seconds) << " = " << timeout_seconds
       << " is invalid: more than 0 and at most " << kMaxTimeoutSeconds << " seconds";
    if (const char* env = std::getenv("EPCOMM_TIMEOUT_SECONDS"))
      os << " (its default comes from EPCOMM_TIMEOUT_SECONDS = '" << env << "')";
    throw Error(ErrorCode::kInvalidArgument, os.str());
  }
  require(int32_t(dispatch_path) >= 0 && int32_t(dispatch_path) < kNumDispatchPaths,
          name(&Config::dispatch_path), "one of DispatchPath's values", int(dispatch_path));
  if (dispatch_path == DispatchPath::kLowLatency)
    require(max_tokens_per_rank <= kLowLatencyMaxTokens, name(&Config::max_tokens_per_rank),
            "at most " + std::to_string(kLowLatencyMaxTokens) +
                " with dispatch_path = kLowLatency (its blocks rank all of a call's tokens "
                "each)",
            max_tokens_per_rank);
  require(max_routed_rows >= 0, name(&Config::max_routed_rows),
          "0 (the worst case) or a positive row count", max_routed_rows);
  if (padded_capacity != 0) {
    require(format == TokenFormat::kBF16 || format == TokenFormat::kFp8Blockwise,
            name(&Config::format),
            std::string("bf16 or fp8-blockwise with padded_capacity (the format is ") +
                token_format_name(format) + ")",
            int(format));
    const RouteMap route = this->route(n_ranks, 0);
    const int64_t most = route.max_group_rows(max_tokens_per_rank);
    require(route.padded_capacity_fits(max_tokens_per_rank, padded_capacity),
            name(&Config::padded_capacity),
            "0 (packed) or at least the most rows a group can receive, " + std::to_string(most) +
                ", with padded_capacity * " + std::to_string(route.groups()) + " groups below 2^31",
            padded_capacity);
  }
  if (fp8_ue8m0_scales)
    require(format == TokenFormat::kFp8Blockwise && fp8_pow2_scales && padded_capacity > 0 &&
                hidden % Ue8m0ScaleLayout::kValuesPerWord == 0,
            name(&Config::fp8_ue8m0_scales),
            "false, or true with format fp8-blockwise, fp8_pow2_scales (UE8M0 holds powers of "
            "two), padded_capacity > 0 and hidden a multiple of 512",
            int(fp8_ue8m0_scales));
  if (shared_expert)
    require(n_experts / n_ranks + 1 <= kMaxExperts, name(&Config::n_experts),
            "at most " + std::to_string(kMaxExperts - 1) +
                " per rank with shared_expert (the shared expert is one more group of at most " +
                std::to_string(kMaxExperts) + ")",
            n_experts);
  if (shared_expert)
    require(top_k < kMaxTopK, name(&Config::top_k),
            "at most " + std::to_string(kMaxTopK - 1) +
                " with shared_expert (the shared expert takes one of the " +
                std::to_string(kMaxTopK) + " slots)",
            top_k);
  require(ranks_per_node >= 0 && ranks_per_node <= n_ranks &&
              (ranks_per_node == 0 || n_ranks % ranks_per_node == 0),
          name(&Config::ranks_per_node),
          "0 (from the hosts) or a divisor of n_ranks = " + std::to_string(n_ranks),
          ranks_per_node);
  require(allreduce_world_size >= 0 && allreduce_world_size <= n_ranks,
          name(&Config::allreduce_world_size),
          "0 (n_ranks) or between 1 and n_ranks = " + std::to_string(n_ranks),
          allreduce_world_size);
}

RouteMap Config::route(int n_ranks, int rank) const {
  return RouteMap::make(n_experts, top_k, n_ranks, rank, shared_expert, skip_a2a,
                        allreduce_world_size);
}

namespace {
// Config's field count: the most values a braced initialiser of it takes (an aggregate). Checked
// here, by the host compiler (nvcc's front end does not resolve AnyValue to float).
struct AnyValue {
  template <class T>
  constexpr operator T() const { return T{}; }
};
template <class T, class... A>
constexpr auto brace_initializable(int) -> decltype(T{std::declval<A>()...}, true) {
  return true;
}
template <class T, class... A>
constexpr bool brace_initializable(...) {
  return false;
}
template <class T, size_t... I>
constexpr bool initializable_from(std::index_sequence<I...>) {
  return brace_initializable<T, decltype((void(I), AnyValue{}))...>(0);
}
}  // namespace
static_assert(std::is_aggregate_v<Config>, "Config stays a plain aggregate");
static_assert(initializable_from<Config>(std::make_index_sequence<kNumConfigFields>()) &&
                  !initializable_from<Config>(
                      std::make_index_sequence<kNumConfigFields + 1>()),
              "kConfigFields must list every field of Config");

namespace {
constexpr bool same_text(const char* a, const char* b) {
  while (*a != '\0' && *a == *b) ++a, ++b;
  return *a == *b;
}
// Entries I and J name the same member or the same name.
template <size_t I, size_t J>
constexpr bool clash() {
  const auto& a = std::get<I>(kConfigFields);
  const auto& b = std::get<J>(kConfigFields);
  bool member = false;
  if constexpr (std::is_same_v<decltype(a.member), decltype(b.member)>) member = a.member == b.member;
  return member || same_text(a.name, b.name);
}
template <size_t I, size_t... J>
constexpr bool clashes_later(std::index_sequence<J...>) {
  return (... || (J > I && clash<I, J>()));
}
template <size_t... I>
constexpr bool all_distinct(std::index_sequence<I...> all) {
  return !(... || clashes_later<I>(all));
}
}  // namespace
// With the count above, distinct members make the table a one-to-one list of Config's fields.
static_assert(all_distinct(std::make_index_sequence<kNumConfigFields>()),
              "kConfigFields lists a member or a name twice");

void check_configs_match(const Config* configs, int n_ranks) {
  const Config& a = configs[0];
  for (int r = 1; r < n_ranks; ++r) {
    const Config& b = configs[r];
    for_each_config_field([&](const auto& field) {
      if (!field.same_on_every_rank) return;
      using T = std::decay_t<decltype(a.*field.member)>;
      // The dispatch path is compared resolved: kAuto and the path it picks agree.
      double va = double(a.*field.member), vb = double(b.*field.member);
      std::string name = field.name;
      if constexpr (std::is_same_v<T, DispatchPath>) {
        va = double(a.resolved_path());
        vb = double(b.resolved_path());
        name += " (resolved)";
      }
      if (va != vb) {
        std::ostringstream os;
        os << "epcomm config mismatch: " << name << " is " << va << " on rank 0 but " << vb
           << " on rank " << r;
        throw Error(ErrorCode::kConfigMismatch, os.str());
      }
    });
  }
}

Sizes compute_sizes(const Config& cfg, int n_ranks) {
  Sizes s;
  s.n_ranks = n_ranks;
  const RouteMap route = cfg.route(n_ranks, 0);  // the same sizes on every rank
  s.n_local_experts = route.n_local();
  s.num_groups = route.groups();
  s.max_routed_rows = route.max_routed_rows(cfg.max_tokens_per_rank);
  if (cfg.max_routed_rows > 0 && cfg.max_routed_rows < s.max_routed_rows)
    s.max_routed_rows = cfg.max_routed_rows;
  const DispatchOutputLayout out =
      DispatchOutputLayout::make(cfg.format, cfg.hidden, s.max_routed_rows, s.num_groups,
                                 cfg.padded_capacity, cfg.fp8_ue8m0_scales);
  s.max_recv_rows = out.rows;
  s.token_bytes = out.row_bytes();
  s.scales_bytes = out.scales_bytes();
  s.num_scales_offsets = format_swizzled(cfg.format) ? s.num_groups : 0;
  return s;
}

}  // namespace epcomm
