// Timing protocol (docs/results/method.md):
// - epcomm: iterations are issued in batches of kBatch with no host synchronisation inside a
//   batch: per iteration and rank, L2 flush, [event] dispatch [event], L2 flush, [event] combine
//   [event]. In the one-process mode the gate holds every stream at the start of a timed batch
//   until all ranks' work is issued; inside a batch the collective calls keep the GPUs in step.
// - NCCL baseline: one iteration at a time (its dispatch waits on the host for the split sizes):
//   flush and wait, then the gated operation between events, then wait.
// - Warm-up iterations run the same way, ungated (first calls may set things up on the host).
// - Input set `it % kInputSets` is used by iteration `it`; every check runs set 0 once more
//   after the timed loops, so state left by a hundred calls is checked too.
// - Expert outputs (combine's input): bf16 workloads use the dispatched tokens themselves; the
//   quantised ones a bf16 array of synthetic values (formats.h) filled once at set-up, read at
//   the rows the dispatch just wrote (padding rows included; combine skips those).
#include "run.h"

#include <algorithm>
#include <numeric>
#include <type_traits>
#include <cstdint>
#include <cstring>
#include <functional>

#include <cstdio>

#include "check.h"
#include "epcomm/detail/launch.h"
#include "epcomm/group.h"
#include "epcomm/reference.h"
#include "floor.h"
#include "formats.h"

namespace epbench {
namespace {

namespace ref = epcomm::reference;

// `array` over the bytes of an output as epcomm/tensors.h describes it (left empty for none).
template <class T>
void allocate(DeviceArray<T>& array, int device, int64_t bytes) {
  if (bytes > 0) array = DeviceArray<T>(device, size_t(bytes) / sizeof(T));
}

constexpr int kBatch = 10;
constexpr uint64_t kSeed = 20261120;

// kGraph: the fused calls, replayed from a CUDA graph captured once per input set.
enum class Form { kFused, kAsyncWait, kGraph };
const char* form_suffix(Form f) {
  return f == Form::kFused ? "" : (f == Form::kAsyncWait ? " async+wait" : " graph");
}

using Samples = std::vector<std::vector<float>>;  // [local rank][iteration], us

// Per rank and iteration, a dispatch's time plus the combine's after it. A rank that ends its
// dispatch early waits for the others inside its combine, so skew between the ranks moves time
// from one figure to the other; their sum per iteration does not depend on where it lands.
Samples round_trip(const Samples& dispatch_us, const Samples& combine_us) {
  Samples sum(dispatch_us.size());
  for (size_t i = 0; i < dispatch_us.size(); ++i)
    for (size_t k = 0; k < dispatch_us[i].size() && k < combine_us[i].size(); ++k)
      sum[i].push_back(dispatch_us[i][k] + combine_us[i][k]);
  return sum;
}

struct RankInputs {  // one input set of one rank, on its device
  DeviceArray<uint16_t> tokens;
  DeviceArray<int32_t> topk_ids;
  DeviceArray<float> weights;
  DeviceInputs view() const { return DeviceInputs{tokens.get(), topk_ids.get(), weights.get()}; }
};

// epcomm's inputs and outputs on one local rank; the outputs as epcomm/tensors.h describes them.
struct RankBuffers {
  std::vector<RankInputs> sets;
  DeviceArray<uint8_t> out_tokens;
  DeviceArray<uint8_t> scales;              // quantised formats only
  DeviceArray<uint32_t> scales_offsets;     // NVFP4 and MXFP8 only
  DeviceArray<uint32_t> row_offsets;
  DeviceArray<int32_t> expert_ids;
  DeviceArray<epcomm::SrcInfo> src_info;
  DeviceArray<uint16_t> synthetic_experts;  // quantised: the expert outputs (expert_out_desc)
  DeviceArray<uint16_t> combine_out;        // reduced, for T tokens

  epcomm::DispatchOutput dispatch_output() const {
    epcomm::DispatchOutput out;
    out.tokens = out_tokens.get();
    out.row_offsets = row_offsets.get();
    out.expert_ids = expert_ids.get();
    out.src_info = src_info.get();
    out.scales = scales.get();
    out.scales_offsets = scales_offsets.get();
    return out;
  }
  // Combine's input rows: the dispatched bf16 tokens, or the synthetic ones.
  const void* expert_out() const {
    return synthetic_experts.get() ? static_cast<const void*>(synthetic_experts.get())
                                   : static_cast<const void*>(out_tokens.get());
  }
};

class WorkloadRun {
 public:
  WorkloadRun(const BenchEnv& env, const Workload& w, const Options& opt)
      : env_(env), team_(env.team), w_(w), opt_(opt) {
    result_.workload = w;
    cfg_.hidden = w.hidden;
    cfg_.top_k = w.top_k;
    cfg_.n_experts = w.experts;
    cfg_.max_tokens_per_rank = w.tokens;
    cfg_.num_sms = opt.num_sms.value_or(cfg_.num_sms);
    cfg_.trace = opt.trace > 0;
    cfg_.dispatch_path = opt.path;
    cfg_.share_gpus = team_.ranks_per_gpu() > 1;
    cfg_.ranks_per_node = opt.ranks_per_node.value_or(0);
    if (opt.timeout_seconds) cfg_.timeout_seconds = *opt.timeout_seconds;
  }

  WorkloadResult run() {
    const std::optional<epcomm::TokenFormat> format = epcomm::token_format_from_name(w_.format);
    if (!format) {
      result_.skipped = "not supported by this build (format " + w_.format + ")";
      return result_;
    }
    if (w_.hidden % epcomm::format_hidden_multiple(*format) != 0) {
      result_.skipped = "H = " + std::to_string(w_.hidden) + " is not a multiple of " +
                        std::to_string(epcomm::format_hidden_multiple(*format)) + " (format " +
                        w_.format + ")";
      return result_;
    }
    cfg_.format = *format;
    if (cfg_.share_gpus && !opt_.num_sms) {  // every sharing rank's blocks resident at once
      const int fit = epcomm::max_resident_blocks(cfg_, team_.n_ranks(), team_.local().front().device) /
                      team_.ranks_per_gpu();
      cfg_.num_sms = std::max(1, std::min(cfg_.num_sms, fit));
    }
    result_.num_sms = cfg_.num_sms;
    result_.path = epcomm::dispatch_path_name(cfg_.resolved_path());
    message_ = MessageFormat{cfg_.format, w_.hidden, cfg_.nvfp4_global_scale};
    result_.dispatch_message_bytes = double(message_.bytes());
    result_.combine_message_bytes = 2.0 * w_.hidden;
    make_inputs();
    create_groups();
    upload_inputs();
    std::vector<Form> forms{Form::kFused, Form::kAsyncWait};
    if (opt_.graph) {
      capture_graphs();
      forms.push_back(Form::kGraph);
    }
    for (Form form : forms) {
      const std::string suffix = form_suffix(form);
      Samples dispatch_us, combine_us, halves[4];
      time_epcomm(form, &dispatch_us, &combine_us, form == Form::kAsyncWait ? halves : nullptr);
      add_ops("epcomm", suffix, dispatch_us, combine_us);
      if (form == Form::kAsyncWait) {
        // The halves of the async+wait pair, each from the start of its launch to the next:
        // the wait half includes any time spent waiting for slower peers.
        const char* names[4] = {"dispatch_async half", "dispatch_wait half", "combine_async half",
                                "combine_wait half"};
        for (int h = 0; h < 4; ++h) result_.ops.push_back(summarize_op(names[h], "epcomm", halves[h]));
      }
      if (opt_.check) result_.checks.push_back(check_epcomm(form));
    }
    if (result_.ranks_per_node > 0) measure_network_bytes();
    if (opt_.trace > 0) trace_epcomm();
    if (opt_.floor) run_floor();
    destroy_graphs();
    groups_.clear();  // free epcomm's buffers before the baseline allocates its own
    free_epcomm_outputs();
    if (env_.comms) run_nccl();
    return result_;
  }

 private:
  cudaStream_t stream(size_t i) const { return team_.local()[i].stream; }
  std::string label(const std::string& what) const { return w_.name + ": " + what; }

  void make_inputs() {
    env_.progress.phase(label("generating inputs"));
    const int n = team_.n_ranks();
    result_.messages.assign(size_t(n), 0.0);
    for (int s = 0; s < kInputSets; ++s) {
      problems_.push_back(ref::make_problem(n, w_.hidden, w_.top_k, w_.experts,
                                            std::vector<int32_t>(size_t(n), w_.tokens),
                                            kSeed + uint64_t(s), w_.zipf_s));
      const std::vector<double> messages = messages_received(problems_.back());
      for (int r = 0; r < n; ++r)
        result_.messages[size_t(r)] += messages[size_t(r)] / kInputSets;
      if (cfg_.ranks_per_node > 0 && cfg_.ranks_per_node < n) {
        result_.ranks_per_node = cfg_.ranks_per_node;
        result_.cross_node_direct.resize(size_t(n), 0.0);
        result_.cross_node_per_node.resize(size_t(n), 0.0);
        // The model, sized as the window lays the group out (measure_network_bytes checks the
        // NVSHMEM byte counters against it).
        const ref::Problem& p = problems_.back();
        traffic_.push_back(ref::cross_node_traffic(
            p, cfg_.ranks_per_node,
            ref::cross_node_sizes(p, cfg_.format, cfg_.max_tokens_per_rank, cfg_.ranks_per_node,
                                  cfg_.resolved_path() == epcomm::DispatchPath::kLowLatency)));
        const std::vector<ref::CrossNodeTraffic>& traffic = traffic_.back();
        for (int r = 0; r < n; ++r) {
          result_.cross_node_direct[size_t(r)] +=
              double(traffic[size_t(r)].direct.dispatch_messages) / kInputSets;
          result_.cross_node_per_node[size_t(r)] +=
              double(traffic[size_t(r)].forwarded.dispatch_messages) / kInputSets;
        }
      }
    }
  }

  // Bytes the local ranks' devices lost to `allocate`, per local rank (cudaMemGetInfo).
  template <class F>
  double measure_per_rank(F&& allocate) {
    std::vector<size_t> before;
    for_each_rank(team_, [&](size_t, const LocalRank&) {
      size_t free_b = 0, total_b = 0;
      CHECK_CUDA(cudaDeviceSynchronize());
      CHECK_CUDA(cudaMemGetInfo(&free_b, &total_b));
      before.push_back(free_b);
    });
    allocate();
    double used = 0;
    for_each_rank(team_, [&](size_t i, const LocalRank& r) {
      for (size_t j = 0; j < i; ++j)
        if (team_.local()[j].device == r.device) return;  // each device once
      size_t free_b = 0, total_b = 0;
      CHECK_CUDA(cudaDeviceSynchronize());
      CHECK_CUDA(cudaMemGetInfo(&free_b, &total_b));
      used += double(before[i]) - double(free_b);
    });
    return used / double(team_.n_local());
  }

  void create_groups() {
    env_.progress.phase(label("set-up"));
    result_.group_bytes = measure_per_rank([&] { create_groups_now(); });
  }

  void create_groups_now() {
    if (team_.multi_process()) {
      groups_.push_back(
          epcomm::Group::create(cfg_, *team_.bootstrap(), team_.local().front().device));
    } else {
      std::vector<int> devices;
      for (const LocalRank& r : team_.local())
        devices.push_back(r.device);
      groups_ = epcomm::Group::create_local(cfg_, devices);
    }
    for (size_t i = 0; i < groups_.size(); ++i)
      if (groups_[i]->rank() != team_.local()[i].rank)
        throw std::runtime_error("epcomm group rank " + std::to_string(groups_[i]->rank()) +
                                 " on local index " + std::to_string(i) + ", expected " +
                                 std::to_string(team_.local()[i].rank));
  }

  void upload_inputs() {
    sizes_ = groups_.front()->sizes();
    if (sizes_.token_bytes != message_.codes_bytes())
      throw std::runtime_error("Group::sizes().token_bytes = " +
                               std::to_string(sizes_.token_bytes) + ", the benchmark expects " +
                               std::to_string(message_.codes_bytes()) + " for " + w_.format);
    for_each_rank(team_, [&](size_t, const LocalRank& r) {
      RankBuffers b;
      for (const ref::Problem& p : problems_) {
        const ref::RankInput& in = p.ranks[size_t(r.rank)];
        b.sets.push_back(RankInputs{DeviceArray<uint16_t>(r.device, in.tokens),
                                    DeviceArray<int32_t>(r.device, in.topk_ids),
                                    DeviceArray<float>(r.device, in.weights)});
      }
      buffers_.push_back(std::move(b));
      events_.emplace_back(r.device, kEventsPerIter * kBatch);
    });
    // The outputs a caller allocates (epcomm/tensors.h), measured apart.
    const epcomm::Config& cfg = groups_.front()->config();
    const std::vector<epcomm::TensorDesc> outs = epcomm::dispatch_output_descs(cfg, sizes_);
    const int64_t combine_bytes = epcomm::combine_output_desc(cfg, w_.tokens, true).bytes();
    result_.output_bytes = measure_per_rank([&] {
      for_each_rank(team_, [&](size_t i, const LocalRank& r) {
        RankBuffers& b = buffers_[i];
        allocate(b.out_tokens, r.device, epcomm::desc_bytes(outs, "tokens"));
        allocate(b.scales, r.device, epcomm::desc_bytes(outs, "scales"));
        allocate(b.scales_offsets, r.device, epcomm::desc_bytes(outs, "scales_offsets"));
        allocate(b.row_offsets, r.device, epcomm::desc_bytes(outs, "row_offsets"));
        allocate(b.expert_ids, r.device, epcomm::desc_bytes(outs, "expert_ids"));
        allocate(b.src_info, r.device, epcomm::desc_bytes(outs, "src_info"));
        allocate(b.combine_out, r.device, combine_bytes);
      });
    });
    for_each_rank(team_, [&](size_t i, const LocalRank& r) {
      if (message_.quantized()) {  // on the stream every later call of this rank uses
        RankBuffers& b = buffers_[i];
        allocate(b.synthetic_experts, r.device, epcomm::expert_out_desc(cfg, sizes_).bytes());
        fill_synthetic_expert_out(b.synthetic_experts.get(), r.rank, sizes_.max_recv_rows,
                                  w_.hidden, r.stream);
      }
    });
  }

  void free_epcomm_outputs() {
    for (RankBuffers& b : buffers_) {
      b.out_tokens = DeviceArray<uint8_t>();
      b.scales = DeviceArray<uint8_t>();
      b.scales_offsets = DeviceArray<uint32_t>();
      b.src_info = DeviceArray<epcomm::SrcInfo>();
      b.synthetic_experts = DeviceArray<uint16_t>();
    }
  }

  std::vector<DeviceInputs> inputs(int set) const {
    std::vector<DeviceInputs> v;
    for (const RankBuffers& b : buffers_)
      v.push_back(b.sets[size_t(set)].view());
    return v;
  }

  // ---- epcomm ----------------------------------------------------------------------------------

  // `between` (optional) runs between dispatch_async and dispatch_wait: the benchmark records an
  // event there to time the two halves.
  void issue_dispatch(size_t i, int set, Form form, const std::function<void()>& between = {}) {
    const RankInputs& in = buffers_[i].sets[size_t(set)];
    epcomm::DispatchInput input;
    input.tokens = in.tokens.get();
    input.topk_ids = in.topk_ids.get();
    input.num_tokens = w_.tokens;
    input.hidden = w_.hidden;
    input.weights = opt_.expert_side ? in.weights.get() : nullptr;
    epcomm::Group& g = *groups_[i];
    if (form == Form::kGraph) {
      CHECK_CUDA(cudaGraphLaunch(graphs_[i][size_t(2 * set)], stream(i)));
    } else if (form == Form::kFused) {
      g.dispatch(input, buffers_[i].dispatch_output(), stream(i));
    } else {
      g.dispatch_async(input, stream(i));
      if (between) between();
      g.dispatch_wait(buffers_[i].dispatch_output(), stream(i));
    }
  }

  void issue_combine(size_t i, int set, Form form, const std::function<void()>& between = {}) {
    const RankBuffers& b = buffers_[i];
    epcomm::CombineInput input;
    input.expert_out = b.expert_out();
    input.row_offsets = b.row_offsets.get();
    input.src_info = b.src_info.get();
    input.hidden = w_.hidden;
    epcomm::CombineOutput output;
    output.out = b.combine_out.get();
    output.weights = opt_.expert_side ? nullptr : b.sets[size_t(set)].weights.get();
    epcomm::Group& g = *groups_[i];
    if (form == Form::kGraph) {
      CHECK_CUDA(cudaGraphLaunch(graphs_[i][size_t(2 * set + 1)], stream(i)));
    } else if (form == Form::kFused) {
      g.combine(input, output, stream(i));
    } else {
      g.combine_async(input, stream(i));
      if (between) between();
      g.combine_wait(output, stream(i));
    }
  }

  // --graph: each local rank's fused dispatch and combine of each input set, captured once
  // ([2 set]: dispatch, [2 set + 1]: combine); replayed by issue_dispatch / issue_combine.
  void capture_graphs() {
    graphs_.assign(team_.n_local(), std::vector<cudaGraphExec_t>(2 * kInputSets, nullptr));
    for_each_rank(team_, [&](size_t i, const LocalRank&) {
      for (int set = 0; set < kInputSets; ++set)
        for (int op = 0; op < 2; ++op) {
          cudaGraph_t graph;
          CHECK_CUDA(cudaStreamBeginCapture(stream(i), cudaStreamCaptureModeRelaxed));
          if (op == 0)
            issue_dispatch(i, set, Form::kFused);
          else
            issue_combine(i, set, Form::kFused);
          CHECK_CUDA(cudaStreamEndCapture(stream(i), &graph));
          CHECK_CUDA(cudaGraphInstantiate(&graphs_[i][size_t(2 * set + op)], graph, 0));
          CHECK_CUDA(cudaGraphDestroy(graph));
        }
    });
  }
  void destroy_graphs() {
    for (std::vector<cudaGraphExec_t>& g : graphs_)
      for (cudaGraphExec_t e : g)
        if (e != nullptr) CHECK_CUDA(cudaGraphExecDestroy(e));
    graphs_.clear();
  }

  // Iterations [first, first + count): batches issued without host synchronisation.
  // Events per iteration: dispatch start, between its halves, end; the same for combine.
  static constexpr int kEventsPerIter = 6;

  void run_epcomm_batches(Form form, int first, int count, bool gated, Samples* dispatch_us,
                          Samples* combine_us, Samples* halves_us = nullptr) {
    for (int start = first; start < first + count; start += kBatch) {
      const int n = std::min(kBatch, first + count - start);
      if (gated)
        for_each_rank(team_, [&](size_t i, const LocalRank&) { env_.gate.hold(stream(i)); });
      for (int j = 0; j < n; ++j) {
        for_each_rank(team_, [&](size_t i, const LocalRank&) {
          Events& ev = events_[i];
          const int e = kEventsPerIter * j;
          env_.flush.run(i, stream(i));
          ev.record(e, stream(i));
          issue_dispatch(i, (start + j) % kInputSets, form,
                         [&] { ev.record(e + 1, stream(i)); });
          ev.record(e + 2, stream(i));
          env_.flush.run(i, stream(i));
          ev.record(e + 3, stream(i));
          issue_combine(i, (start + j) % kInputSets, form,
                        [&] { ev.record(e + 4, stream(i)); });
          ev.record(e + 5, stream(i));
        });
      }
      if (gated) env_.gate.release();
      for_each_rank(team_, [&](size_t i, const LocalRank&) { groups_[i]->synchronize(stream(i)); });
      env_.gate.check();
      if (dispatch_us)
        for (size_t i = 0; i < team_.n_local(); ++i)
          for (int j = 0; j < n; ++j) {
            const int e = kEventsPerIter * j;
            (*dispatch_us)[i].push_back(events_[i].elapsed_us(e, e + 2));
            (*combine_us)[i].push_back(events_[i].elapsed_us(e + 3, e + 5));
            if (halves_us) {
              halves_us[0][i].push_back(events_[i].elapsed_us(e, e + 1));
              halves_us[1][i].push_back(events_[i].elapsed_us(e + 1, e + 2));
              halves_us[2][i].push_back(events_[i].elapsed_us(e + 3, e + 4));
              halves_us[3][i].push_back(events_[i].elapsed_us(e + 4, e + 5));
            }
          }
      env_.progress.tick(start + n, opt_.warmup + opt_.iters);
    }
  }

  // halves_us (async+wait only): dispatch_async, dispatch_wait, combine_async, combine_wait.
  void time_epcomm(Form form, Samples* dispatch_us, Samples* combine_us,
                   Samples* halves_us = nullptr) {
    env_.progress.phase(
        label(form == Form::kAsyncWait ? "epcomm async+wait"
                                       : std::string("epcomm dispatch/combine") + form_suffix(form)));
    dispatch_us->assign(team_.n_local(), {});
    combine_us->assign(team_.n_local(), {});
    if (halves_us)
      for (int h = 0; h < 4; ++h) halves_us[h].assign(team_.n_local(), {});
    run_epcomm_batches(form, 0, opt_.warmup, false, nullptr, nullptr);
    run_epcomm_batches(form, opt_.warmup, opt_.iters, true, dispatch_us, combine_us, halves_us);
  }

  // Declared nodes: what each local rank puts through NVSHMEM in one fused dispatch and the
  // combine after it, for every input set, against the byte model's count for the same calls;
  // a check, since the two must agree exactly.
  void measure_network_bytes() {
    env_.progress.phase(label("bytes through NVSHMEM"));
    const size_t n_local = team_.n_local();
    auto counters = [&] {
      std::vector<uint64_t> c(n_local);
      for_each_rank(team_, [&](size_t i, const LocalRank&) {
        groups_[i]->synchronize(stream(i));
        c[i] = groups_[i]->network_bytes_put();
      });
      return c;
    };
    double measured[2] = {0, 0}, model[2] = {0, 0};
    std::string mismatches;
    for (int set = 0; set < kInputSets; ++set) {
      const std::vector<ref::CrossNodeTraffic>& model_of = traffic_[size_t(set)];
      const std::vector<uint64_t> c0 = counters();
      for_each_rank(team_, [&](size_t i, const LocalRank&) { issue_dispatch(i, set, Form::kFused); });
      const std::vector<uint64_t> c1 = counters();
      for_each_rank(team_, [&](size_t i, const LocalRank&) { issue_combine(i, set, Form::kFused); });
      const std::vector<uint64_t> c2 = counters();
      for (size_t i = 0; i < n_local; ++i) {
        const int rank = team_.local()[i].rank;
        const ref::CrossNodePuts& m = model_of[size_t(rank)].direct;
        const double want[2] = {double(m.dispatch_bytes),
                                double(opt_.expert_side ? m.combine_bytes_expert_side
                                                        : m.combine_bytes_token_side)};
        const double got[2] = {double(c1[i] - c0[i]), double(c2[i] - c1[i])};
        for (int op = 0; op < 2; ++op) {
          measured[op] += got[op];
          model[op] += want[op];
          if (got[op] != want[op])
            mismatches += " rank " + std::to_string(rank) + (op == 0 ? " dispatch " : " combine ") +
                          std::to_string(int64_t(got[op])) + " B, model " +
                          std::to_string(int64_t(want[op])) + " B (set " + std::to_string(set) + ");";
        }
      }
    }
    const double n = double(n_local) * kInputSets;
    result_.network_dispatch_bytes = measured[0] / n;
    result_.network_combine_bytes = measured[1] / n;
    result_.model_dispatch_bytes = model[0] / n;
    result_.model_combine_bytes = model[1] / n;
    result_.checks.push_back(CheckResult{"bytes through NVSHMEM = model", mismatches.empty(),
                                         mismatches});
  }

  // --trace: opt_.trace fused dispatch + combine calls issued like the timed ones (gated, L2
  // flushed before each), one at a time, reading every rank's stage marks after each.
  void trace_epcomm() {
    env_.progress.phase(label("stage trace"));
    constexpr int K = epcomm::kTraceKernels, M = epcomm::kTraceMarks;
    const size_t n_local = team_.n_local();
    constexpr int Q = StageSummary::kQuantiles;
    // [local rank][quantile][kernel * M + mark] -> per-call samples of the block at that
    // quantile, µs.
    std::vector<std::vector<std::vector<std::vector<double>>>> at(
        n_local,
        std::vector<std::vector<std::vector<double>>>(Q, std::vector<std::vector<double>>(K * M)));
    std::vector<double> passed(n_local * K * M, 0.0);
    int blocks = 0;
    for (int it = 0; it < opt_.trace; ++it) {
      for_each_rank(team_, [&](size_t i, const LocalRank&) { env_.gate.hold(stream(i)); });
      for_each_rank(team_, [&](size_t i, const LocalRank&) {
        env_.flush.run(i, stream(i));
        issue_dispatch(i, it % kInputSets, Form::kFused);
        env_.flush.run(i, stream(i));
        issue_combine(i, it % kInputSets, Form::kFused);
      });
      env_.gate.release();
      for_each_rank(team_, [&](size_t i, const LocalRank&) {
        groups_[i]->synchronize(stream(i));
        const epcomm::StageTrace t = groups_[i]->stage_trace();
        blocks = t.blocks;
        for (int k = 0; k < K; ++k) {
          uint64_t start = UINT64_MAX;
          for (int b = 0; b < t.blocks; ++b)
            if (t.at(k, epcomm::kTraceStart, b) != 0) start = std::min(start, t.at(k, epcomm::kTraceStart, b));
          for (int m = 0; m < M; ++m) {
            std::vector<uint64_t> when;  // the blocks that passed the mark
            for (int b = 0; b < t.blocks; ++b) {
              const uint64_t v = t.at(k, m, b);
              if (v != 0 && v >= start) when.push_back(v);
            }
            if (when.empty()) continue;
            std::sort(when.begin(), when.end());
            for (int q = 0; q < Q; ++q) {
              const size_t b =
                  size_t(StageSummary::kBlockQuantiles[q] * double(when.size() - 1) + 0.5);
              at[i][q][k * M + m].push_back(double(when[b] - start) / 1e3);
            }
            passed[(i * K + k) * M + m] = double(when.size());
          }
        }
      });
      env_.gate.check();
    }
    auto median = [](std::vector<double> v) {
      return v.empty() ? -1.0 : double(summarize(std::vector<float>(v.begin(), v.end())).median_us);
    };
    // (Each rank's marks are taken from its own kernel start: the GPUs' timers do not agree,
    // measured hundreds of µs apart on one machine.)
    std::vector<double> local;  // per local rank: each quantile's [K*M], then passed[K*M]
    for (size_t i = 0; i < n_local; ++i) {
      for (int q = 0; q < Q; ++q)
        for (int j = 0; j < K * M; ++j)
          local.push_back(median(at[i][q][j]));
      for (int j = 0; j < K * M; ++j) local.push_back(passed[i * K * M + j]);
    }
    const size_t per_rank = (Q + 1) * K * M;
    const std::vector<double> all = team_.gather(local, per_rank);
    StageSummary& s = result_.stages;
    s.calls = opt_.trace;
    s.blocks = blocks;
    for (size_t r = 0; r * per_rank < all.size(); ++r) {
      const double* v = all.data() + r * per_rank;
      for (int q = 0; q < Q; ++q)
        s.at_us[q].insert(s.at_us[q].end(), v + q * K * M, v + (q + 1) * K * M);
      s.passed.insert(s.passed.end(), v + Q * K * M, v + (Q + 1) * K * M);
    }
  }

  CheckResult check_epcomm(Form form) {
    const Reference& ref = reference();
    for_each_rank(team_, [&](size_t i, const LocalRank&) {
      issue_dispatch(i, 0, form);
      issue_combine(i, 0, form);
    });
    std::vector<std::string> failures(team_.n_local());
    for_each_rank(team_, [&](size_t i, const LocalRank& r) {
      groups_[i]->synchronize(stream(i));
      std::string msg = check_dispatch(ref, i, r.rank, buffers_[i].dispatch_output(), sizes_);
      if (!msg.empty()) {
        failures[i] = "dispatch: " + msg;
        return;
      }
      const std::vector<uint16_t> out =
          buffers_[i].combine_out.download(size_t(w_.tokens) * size_t(w_.hidden));
      msg = opt_.expert_side ? check_combine_expert_side(ref.combine_expert_side[i], out)
                             : check_combine(ref.combine[i], out);
      if (!msg.empty()) failures[i] = "combine: " + msg;
    });
    return verdict(std::string("epcomm") + form_suffix(form), failures);
  }

  // ---- the memory floor (--floor, floor.h) ----------------------------------------------------

  // Every local rank's floor kernels at once (gated), the L2 flushed before each, as the epcomm
  // calls are timed. `launch(i)` issues local rank i's kernel on its stream.
  OpResult time_floor(const std::string& op, const std::function<void(size_t)>& launch) {
    Samples us(team_.n_local());
    constexpr int kFloorWarmup = 3;
    for (int start = 0; start < kFloorWarmup + opt_.iters; start += kBatch) {
      const int n = std::min(kBatch, kFloorWarmup + opt_.iters - start);
      for_each_rank(team_, [&](size_t i, const LocalRank&) { env_.gate.hold(stream(i)); });
      for (int j = 0; j < n; ++j)
        for_each_rank(team_, [&](size_t i, const LocalRank&) {
          env_.flush.run(i, stream(i));
          events_[i].record(2 * j, stream(i));
          launch(i);
          events_[i].record(2 * j + 1, stream(i));
        });
      env_.gate.release();
      for_each_rank(
          team_, [&](size_t i, const LocalRank&) { CHECK_CUDA(cudaStreamSynchronize(stream(i))); });
      env_.gate.check();
      for (size_t i = 0; i < team_.n_local(); ++i)
        for (int j = 0; j < n; ++j)
          if (start + j >= kFloorWarmup) us[i].push_back(events_[i].elapsed_us(2 * j, 2 * j + 1));
    }
    return summarize_op(op, "floor", us);
  }

  // Plans from the CPU reference's layouts (unpadded rows; the bytes are what count), then each
  // variant of each floor, timed. The floors write into the benchmark's own output buffers.
  // Checked (bf16 only, where the reference holds the rows): the dispatch floor's rows and the
  // combine floor's weighted sums.
  void run_floor() {
    // Every floor kernel's attributes, once per GPU, for the latency floor and the byte floors.
    for_each_rank(team_,
                  [&](size_t, const LocalRank&) { prepare_floor_kernels(w_.top_k, w_.hidden); });
    run_latency_floor();
    const int device = team_.local().front().device;
    for (const LocalRank& r : team_.local())
      if (r.device != device) {
        result_.floor_skipped = "--floor needs every rank on one GPU";
        return;
      }
    if (team_.multi_process() && team_.n_ranks() > 1) {
      result_.floor_skipped = "--floor needs one process";
      return;
    }
    const Reference& ref = reference();
    env_.progress.phase(label("memory floor"));
    const int32_t n = team_.n_ranks(), T = w_.tokens, K = w_.top_k, H = w_.hidden;
    const int32_t n_local_experts = w_.experts / n;
    const int64_t code_bytes = message_.codes_bytes();
    const int64_t scale_bytes = epcomm::align_up(message_.scales_bytes(), 16);
    set_device(device);

    // Rows of every rank's layout by (source, token, slot).
    std::vector<std::vector<int32_t>> row_of(static_cast<size_t>(n));
    for (int32_t o = 0; o < n; ++o) {
      row_of[size_t(o)].assign(size_t(n) * T * K, -1);
      const std::vector<epcomm::SrcInfo>& info = ref.dispatch[size_t(o)].src_info;
      for (size_t row = 0; row < info.size(); ++row)
        row_of[size_t(o)][(size_t(info[row].rank) * T + size_t(info[row].token)) * K +
                          size_t(info[row].slot)] = int32_t(row);
    }
    struct Plan {
      DeviceArray<const uint16_t*> src, combine_src;
      DeviceArray<int32_t> first, rows;
      DeviceArray<uint8_t> scales;
      DeviceArray<unsigned long long> pinned;  // the pinned variants' work counters
      // The contiguous-rows diagnostic: the same messages and rows, laid out one after another.
      DeviceArray<int32_t> contig_rows;
      DeviceArray<const uint16_t*> contig_src;
      DispatchFloorArgs contig_d;
      CombineFloorArgs contig_c;
      DispatchFloorArgs d;
      CombineFloorArgs c;
      double dispatch_bytes = 0, combine_bytes = 0;
    };
    std::vector<Plan> plans(team_.n_local());
    // The contiguous-rows diagnostic reads token t's slot k from row t K + k of a rank's own
    // expert outputs: they must hold T K rows.
    const bool contig = int64_t(T) * K <= sizes_.max_recv_rows;
    double dispatch_bytes = 0, combine_bytes = 0;
    for (size_t i = 0; i < team_.n_local(); ++i) {
      const int32_t r = team_.local()[i].rank;
      // Dispatch: the messages (source, token) routed here, in source then token order.
      std::vector<const uint16_t*> src;
      std::vector<int32_t> first{0}, rows;
      for (int32_t s = 0; s < n; ++s) {
        const uint16_t* tokens = buffers_[size_t(s)].sets[0].tokens.get();
        for (int32_t t = 0; t < T; ++t) {
          const size_t before = rows.size();
          for (int32_t k = 0; k < K; ++k) {
            const int32_t row = row_of[size_t(r)][(size_t(s) * T + size_t(t)) * K + size_t(k)];
            if (row >= 0) rows.push_back(row);
          }
          if (rows.size() == before) continue;
          src.push_back(tokens + int64_t(t) * H);
          first.push_back(int32_t(rows.size()));
        }
      }
      // Combine: this rank's tokens' expert rows, wherever they were dispatched.
      std::vector<const uint16_t*> combine_src(size_t(T) * K, nullptr);
      const std::vector<int32_t>& ids = problems_.front().ranks[size_t(r)].topk_ids;
      int64_t live = 0;
      for (int32_t t = 0; t < T; ++t)
        for (int32_t k = 0; k < K; ++k) {
          const int32_t id = ids[size_t(t) * K + size_t(k)];
          if (id < 0) continue;
          const int32_t o = id / n_local_experts;
          const int32_t row = row_of[size_t(o)][(size_t(r) * T + size_t(t)) * K + size_t(k)];
          if (row < 0) continue;
          combine_src[size_t(t) * K + size_t(k)] =
              static_cast<const uint16_t*>(buffers_[size_t(o)].expert_out()) + int64_t(row) * H;
          ++live;
        }
      Plan& p = plans[i];
      p.src = DeviceArray<const uint16_t*>(device, src);
      p.first = DeviceArray<int32_t>(device, first);
      p.rows = DeviceArray<int32_t>(device, rows);
      p.combine_src = DeviceArray<const uint16_t*>(device, combine_src);
      if (scale_bytes > 0)
        p.scales = DeviceArray<uint8_t>(device, rows.size() * size_t(scale_bytes));
      p.d.src = p.src.get();
      p.d.first = p.first.get();
      p.d.rows = p.rows.get();
      p.d.messages = int32_t(src.size());
      p.d.in_bytes = 2 * H;
      p.d.code_bytes = int32_t(code_bytes);
      p.d.scale_bytes = int32_t(scale_bytes);
      p.d.out = reinterpret_cast<char*>(buffers_[i].out_tokens.get());
      p.d.scales = reinterpret_cast<char*>(p.scales.get());
      p.pinned = DeviceArray<unsigned long long>(device, std::vector<unsigned long long>(2, 0));
      p.d.pinned = p.pinned.get();
      p.c.pinned = p.pinned.get();
      p.d.first_sm = p.c.first_sm = int32_t(i) * cfg_.num_sms;
      p.c.src = p.combine_src.get();
      p.c.weights = buffers_[i].sets[0].weights.get();
      p.c.tokens = T;
      p.c.top_k = K;
      p.c.hidden = H;
      p.c.out = buffers_[i].combine_out.get();
      // Contiguous: message m's rows right after message m-1's, token t's slot k at row t K + k.
      if (contig) {
        std::vector<int32_t> seq(rows.size());
        std::iota(seq.begin(), seq.end(), 0);
        std::vector<const uint16_t*> csrc(combine_src.size(), nullptr);
        const uint16_t* base = static_cast<const uint16_t*>(buffers_[i].expert_out());
        for (size_t j = 0; j < csrc.size(); ++j)
          if (combine_src[j] != nullptr) csrc[j] = base + int64_t(j) * H;
        p.contig_rows = DeviceArray<int32_t>(device, seq);
        p.contig_src = DeviceArray<const uint16_t*>(device, csrc);
        p.contig_d = p.d;
        p.contig_d.rows = p.contig_rows.get();
        p.contig_c = p.c;
        p.contig_c.src = p.contig_src.get();
      }
      dispatch_bytes +=
          double(src.size()) * 2 * H + double(rows.size()) * double(code_bytes + scale_bytes);
      combine_bytes += double(live) * 2 * H + double(T) * 2 * H;
    }
    dispatch_bytes /= double(team_.n_local());
    combine_bytes /= double(team_.n_local());
    const int sms = cfg_.num_sms;
    int sm_count = 0;
    CHECK_CUDA(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
    // The pinned shapes give local rank i SMs [i sms, (i + 1) sms): they must be on the GPU.
    const bool pinned = int64_t(team_.n_local()) * sms <= sm_count;
    // Every variant of one floor timed on args_of(plan) as "<op> <series> <variant>": the series
    // "floor" counts as the floor; "contiguous" is a diagnostic (below).
    auto sweep = [&](const std::string& series, auto args_of, double bytes,
                     const std::function<void(const std::string&)>& check) {
      constexpr bool dispatch =
          std::is_same_v<decltype(args_of(plans[0])), const DispatchFloorArgs&>;
      for (const FloorVariant& v : floor_variants(dispatch, pinned)) {
        if (series != "floor" && v.kind == FloorVariant::kTma) continue;  // no row mapping
        const std::string name =
            std::string(dispatch ? "dispatch " : "combine ") + series + " " + floor_variant_name(v);
        OpResult r = time_floor(name, [&](size_t i) {
          if constexpr (dispatch)
            launch_dispatch_floor(args_of(plans[i]), v, sms, stream(i));
          else
            launch_combine_floor(args_of(plans[i]), v, sms, stream(i));
        });
        r.impl = series;
        r.bytes_per_rank = bytes;
        result_.ops.push_back(r);
        if (check) check(name);
      }
    };
    const bool check_rows = opt_.check && !message_.quantized();
    sweep("floor", [](const Plan& p) -> const DispatchFloorArgs& { return p.d; },
          dispatch_bytes,
          [&](const std::string& name) { if (check_rows) check_floor_dispatch(ref, name); });
    sweep("floor", [](const Plan& p) -> const CombineFloorArgs& { return p.c; },
          combine_bytes,
          [&](const std::string& name) { if (check_rows) check_floor_combine(ref, name); });
    // A diagnostic, not a floor (epcomm's rows sit where the layout puts them): the same bytes
    // with each message's rows and each token's expert rows contiguous, as a plain copy kernel
    // lays them out, in the same launch shapes. Against the floor it separates what the
    // expert-major layout's scattered rows cost from what the launch shape costs.
    if (!contig) return;
    sweep("contiguous", [](const Plan& p) -> const DispatchFloorArgs& { return p.contig_d; },
          dispatch_bytes, nullptr);
    sweep("contiguous", [](const Plan& p) -> const CombineFloorArgs& { return p.contig_c; },
          combine_bytes, nullptr);
  }

  // The latency floor (floor.h), what a call pays before it moves a byte: epcomm's grid
  // launched empty, and with one flag round trip around the local ranks (on their own GPUs:
  // over the links where they are on different ones), timed like the byte floors; checked that
  // no round trip's wait ran out. Needs the groups (they enabled peer access between the GPUs)
  // and prepare_floor_kernels.
  void run_latency_floor() {
    const int threads = epcomm::detail::dispatch_threads();
    const int blocks = cfg_.num_sms;
    const size_t n = team_.n_local();
    std::vector<DeviceArray<unsigned long long>> state;  // per local rank: {flag, calls}
    std::vector<DeviceArray<int>> failed;
    for (const LocalRank& r : team_.local()) {
      state.emplace_back(r.device, std::vector<unsigned long long>{0, 0});
      failed.emplace_back(r.device, std::vector<int>{0});
    }
    const auto args = [&](size_t i) {
      RoundTripArgs a;
      a.mine = state[i].get();
      a.next = state[(i + 1) % n].get();
      a.calls = state[i].get() + 1;
      a.failed = failed[i].get();
      return a;
    };
    OpResult empty =
        time_floor("launch empty", [&](size_t i) { launch_empty(blocks, threads, stream(i)); });
    OpResult trip = time_floor("launch roundtrip", [&](size_t i) {
      launch_roundtrip(args(i), blocks, threads, stream(i));
    });
    for (OpResult* r : {&empty, &trip}) {
      r->impl = "latency";
      r->bytes_per_rank = 0;
      result_.ops.push_back(*r);
    }
    std::vector<std::string> failures(n);
    for (size_t i = 0; i < n; ++i)
      if (failed[i].download(1)[0] != 0)
        failures[i] = "a round trip's wait ran out (1 s): the previous rank's store never came";
    result_.checks.push_back(verdict("latency floor", failures));
  }

  // The floor's bf16 rows against the reference's (the floor wrote them at the reference's rows).
  void check_floor_dispatch(const Reference& ref, const std::string& what) {
    std::vector<std::string> failures(team_.n_local());
    for_each_rank(team_, [&](size_t i, const LocalRank& r) {
      const epcomm::reference::DispatchResult& d = ref.dispatch[size_t(r.rank)];
      const size_t count = size_t(d.rows()) * size_t(w_.hidden);
      const std::vector<uint8_t> got = buffers_[i].out_tokens.download(count * 2);
      if (std::memcmp(got.data(), d.tokens.data(), count * 2) != 0)
        failures[i] = "rows differ from the reference";
    });
    result_.checks.push_back(verdict(what, failures));
  }

  void check_floor_combine(const Reference& ref, const std::string& what) {
    std::vector<std::string> failures(team_.n_local());
    if (floor_combine_ref_.empty()) {  // token-side weighted sums of the reference's rows
      std::vector<std::vector<uint16_t>> rows;
      for (const epcomm::reference::DispatchResult& d : ref.dispatch)
        rows.push_back(d.tokens);
      for (const LocalRank& r : team_.local())
        floor_combine_ref_.push_back(
            ref::combine(problems_.front(), ref.dispatch, rows, r.rank, /*weighted=*/true));
    }
    for_each_rank(team_, [&](size_t i, const LocalRank&) {
      const std::vector<uint16_t> out =
          buffers_[i].combine_out.download(size_t(w_.tokens) * size_t(w_.hidden));
      failures[i] = check_combine(floor_combine_ref_[i], out);
    });
    result_.checks.push_back(verdict(what, failures));
  }

  // ---- NCCL baseline ---------------------------------------------------------------------------

  void run_nccl() {
    BaselineShape shape;
    shape.tokens = w_.tokens;
    shape.hidden = w_.hidden;
    shape.top_k = w_.top_k;
    shape.n_experts = w_.experts;
    shape.capacity_rows = sizes_.max_routed_rows;  // no format padding: one row per (token, k)
    shape.message = message_;
    NcclBaseline nccl(team_, *env_.comms, shape);
    env_.progress.phase(label("NCCL baseline"));
    Samples dispatch_us(team_.n_local()), combine_us(team_.n_local());
    const int total = opt_.warmup + opt_.iters;
    for (int it = 0; it < total; ++it) {
      const bool timed = it >= opt_.warmup;
      const std::vector<DeviceInputs> in = inputs(it % kInputSets);
      flush_and_wait();
      nccl.dispatch(in, hooks(0, timed));
      flush_and_wait();
      nccl.combine(in, hooks(2, timed));
      wait_all();
      env_.gate.check();
      if (timed)
        for (size_t i = 0; i < team_.n_local(); ++i) {
          dispatch_us[i].push_back(events_[i].elapsed_us(0, 1));
          combine_us[i].push_back(events_[i].elapsed_us(2, 3));
        }
      env_.progress.tick(it + 1, total);
    }
    add_ops("nccl", "", dispatch_us, combine_us);
    if (opt_.check) result_.checks.push_back(check_nccl(nccl));
  }

  // Events first_event and first_event + 1 around the operation; the gate holds its start.
  TimingHooks hooks(int first_event, bool gated) {
    TimingHooks h;
    h.begin = [this, first_event, gated](size_t i) {
      if (gated) env_.gate.hold(stream(i));
      events_[i].record(first_event, stream(i));
    };
    h.issued = [this, gated] {
      if (gated) env_.gate.release();
    };
    h.end = [this, first_event](size_t i) { events_[i].record(first_event + 1, stream(i)); };
    return h;
  }

  void wait_all() {
    for_each_rank(
        team_, [&](size_t i, const LocalRank&) { CHECK_CUDA(cudaStreamSynchronize(stream(i))); });
  }

  void flush_and_wait() {  // outside the timed region
    for_each_rank(team_, [&](size_t i, const LocalRank&) { env_.flush.run(i, stream(i)); });
    wait_all();
  }

  CheckResult check_nccl(NcclBaseline& nccl) {
    const Reference& ref = reference();
    const std::vector<DeviceInputs> in = inputs(0);
    TimingHooks none;
    none.begin = none.end = [](size_t) {};
    none.issued = [] {};
    nccl.dispatch(in, none);
    nccl.combine(in, none);
    wait_all();
    std::vector<std::string> failures(team_.n_local());
    for_each_rank(team_, [&](size_t i, const LocalRank& r) {
      const int64_t rows = ref.dispatch[size_t(r.rank)].rows();
      std::string msg =
          check_expert_major(ref, r.rank, nccl.row_offsets(i), nccl.dispatch_rows(i, rows));
      if (!msg.empty()) {
        failures[i] = "dispatch: " + msg;
        return;
      }
      msg = check_combine(message_.quantized() ? ref.nccl_combine[i] : ref.combine[i],
                          nccl.combine_out(i));
      if (!msg.empty()) failures[i] = "combine: " + msg;
    });
    return verdict("nccl", failures);
  }

  // ---- results ---------------------------------------------------------------------------------

  const Reference& reference() {
    if (!reference_) {
      env_.progress.phase(label("computing the CPU reference"));
      reference_ = std::make_unique<Reference>(
          build_reference(problems_.front(), team_, message_, sizes_, env_.comms != nullptr,
                          opt_.expert_side));
    }
    return *reference_;
  }

  // Prints this process's failures; the verdict covers every rank.
  CheckResult verdict(const std::string& what, const std::vector<std::string>& failures) const {
    std::vector<double> flags;
    for (size_t i = 0; i < failures.size(); ++i) {
      flags.push_back(failures[i].empty() ? 0.0 : 1.0);
      if (!failures[i].empty())
        std::fprintf(stderr, "\n[rank %d] %s %s FAIL: %s\n", team_.local()[i].rank, w_.name.c_str(),
                     what.c_str(), failures[i].c_str());
    }
    const std::vector<double> all = team_.gather(flags, 1);
    CheckResult c;
    c.what = what;
    c.pass = true;
    for (size_t r = 0; r < all.size(); ++r) {
      if (all[r] == 0.0) continue;
      c.detail += (c.pass ? "rank " : ", ") + std::to_string(r);
      c.pass = false;
    }
    return c;
  }

  // The dispatch, combine and dispatch+combine rows of one implementation and form.
  void add_ops(const std::string& impl, const std::string& suffix, const Samples& dispatch_us,
               const Samples& combine_us) {
    result_.ops.push_back(summarize_op("dispatch" + suffix, impl, dispatch_us));
    result_.ops.push_back(summarize_op("combine" + suffix, impl, combine_us));
    result_.ops.push_back(
        summarize_op("dispatch+combine" + suffix, impl, round_trip(dispatch_us, combine_us)));
  }

  OpResult summarize_op(const std::string& op, const std::string& impl, const Samples& samples) {
    std::vector<double> local;
    for (const std::vector<float>& s : samples) {
      const Stats st = summarize(s);
      local.insert(local.end(), {st.median_us, st.min_us, st.max_us});
    }
    const std::vector<double> all = team_.gather(local, 3);
    OpResult r;
    r.op = op;
    r.impl = impl;
    for (size_t k = 0; k + 2 < all.size(); k += 3)
      r.ranks.push_back({all[k], all[k + 1], all[k + 2]});
    r.bytes_per_rank = result_.bytes_per_rank(op);
    return r;
  }

  const BenchEnv& env_;
  const Team& team_;
  Workload w_;
  const Options& opt_;
  epcomm::Config cfg_;
  MessageFormat message_;               // the dispatch format's per-token message
  epcomm::Sizes sizes_;                 // of the group (kept after the group is freed)
  std::vector<ref::Problem> problems_;  // one per input set
  // Across declared nodes: each set's traffic model (reference::cross_node_traffic), per rank.
  std::vector<std::vector<ref::CrossNodeTraffic>> traffic_;
  std::vector<std::unique_ptr<epcomm::Group>> groups_;  // per local rank
  std::vector<std::vector<cudaGraphExec_t>> graphs_;     // --graph: per local rank, capture_graphs
  std::vector<RankBuffers> buffers_;                    // per local rank
  std::vector<Events> events_;                          // per local rank: 4 per batch iteration
  std::unique_ptr<Reference> reference_;
  std::vector<std::vector<double>> floor_combine_ref_;  // --floor's combine check, per local rank
  WorkloadResult result_;
};

}  // namespace

WorkloadResult run_workload(const BenchEnv& env, const Workload& workload, const Options& opt) {
  return WorkloadRun(env, workload, opt).run();
}

}  // namespace epbench
