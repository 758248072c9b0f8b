// The group: epcomm::Group and the output buffers the Python API reuses call after call.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "arrays.h"
#include "bindings.h"
#include "epcomm/config.h"
#include "epcomm/group.h"
#include "epcomm/tensors.h"

namespace epcomm_py {

using namespace nb::literals;

namespace {

// ---- device buffers owned by a Python group ----------------------------------------------------

struct DeviceBuffer {
  void* ptr = nullptr;
  int64_t bytes = 0;
  int device = 0;
  void allocate(int dev, int64_t n) {
    device = dev;
    bytes = n;
    if (n > 0) cuda_check(cudaMalloc(&ptr, size_t(n)), "epcomm: cudaMalloc of an output buffer");
  }
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr) {
      DeviceGuard g;
      (void)cudaSetDevice(device);
      (void)cudaFree(ptr);
    }
  }
};

// ---- the group ---------------------------------------------------------------------------------

// A Group and the output buffers the Python API reuses call after call (allocated at set-up on
// the group's device; the un-reduced [T, K, H] combine output at its first use).
class PyGroup {
 public:
  explicit PyGroup(std::unique_ptr<epcomm::Group> g) : g_(std::move(g)) {
    if (!g_) invalid("epcomm: no group");
    DeviceGuard guard;
    cuda_check(cudaSetDevice(live()->device()), "epcomm: cudaSetDevice");
    const epcomm::Config& c = live()->config();
    const int d = live()->device();
    descs_ = epcomm::dispatch_output_descs(c, live()->sizes());
    for (const epcomm::TensorDesc& desc : descs_)
      if (!lazy(desc.name)) dispatch_buffer(desc.name).allocate(d, desc.bytes());
    out_.allocate(d, epcomm::combine_output_desc(c, c.max_tokens_per_rank, true).bytes());
  }

  // In the padded layout (Config::padded_capacity) the group's own tokens, scales, counts,
  // slot_token and layout_range are allocated at their first use: G * C rows can be far more
  // than a dispatch fills, and a caller such as the DeepEP layer passes its own.
  bool lazy(const std::string& name) const {
    return live()->config().padded_capacity > 0 &&
           (name == "tokens" || name == "scales" || name == "counts" || name == "slot_token" ||
            name == "layout_range");
  }
  // stream: the call's, checked for capture (none: a buffer view, outside any call).
  void allocate_lazy(const char* op, std::optional<uintptr_t> stream) {
    if (padded_own_) return;
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    if (stream) cuda_check(cudaStreamIsCapturing(as_stream(*stream), &st), "cudaStreamIsCapturing");
    if (st != cudaStreamCaptureStatusNone)
      invalid(std::string(op) +
              ": the group's own padded-layout outputs are allocated at their first use, which "
              "cannot happen during graph capture: run one dispatch before capturing, or pass "
              "every output");
    DeviceGuard guard;
    cuda_check(cudaSetDevice(live()->device()), "cudaSetDevice");
    for (const epcomm::TensorDesc& desc : descs_)  // (kept where an earlier try got them)
      if (lazy(desc.name) && !dispatch_buffer(desc.name).ptr)
        dispatch_buffer(desc.name).allocate(live()->device(), desc.bytes());
    padded_own_ = true;
  }

  // An array's data, or for an empty one (T = 0, where frameworks may give a null pointer) a
  // valid pointer that is never read: a given argument must stay non-null, since the library
  // takes a null weights pointer to mean "no router weights" (and every rank must agree).
  const void* present(const Array& a) const { return a.data() ? a.data() : out_.ptr; }

  epcomm::Group& g() { return *live(); }
  const epcomm::Group& g() const { return *live(); }
  // Tears the group down (collective: every rank closes at the same point; the destructor
  // waits for the peers through the bootstrap). The output buffers stay until the Python
  // object goes, since tensors may still view them.
  void close() {
    std::unique_ptr<epcomm::Group> g = std::move(g_);
    nb::gil_scoped_release nogil;
    DeviceGuard guard;
    g.reset();
  }
  bool closed() const { return g_ == nullptr; }
  Ctx ctx(const char* op) const {
    return Ctx{"epcomm " + std::string(op) + " (rank " + std::to_string(live()->rank()) + ")",
               live()->device()};
  }

  // The outputs of dispatch: the caller's buffers where given, else the group's.
  epcomm::DispatchOutput dispatch_output(
      const Ctx& c, const std::optional<Array>& tokens, const std::optional<Array>& scales,
      const std::optional<Array>& row_offsets, const std::optional<Array>& expert_ids,
      const std::optional<Array>& src_info, const std::optional<Array>& scales_offsets,
      const std::optional<Array>& counts, const std::optional<Array>& slot_token,
      const std::optional<Array>& layout_range, uintptr_t stream) {
    const bool any = tokens || scales || row_offsets || expert_ids || src_info || scales_offsets ||
                     counts || slot_token || layout_range;
    if (!any) {
      allocate_lazy(c.op.c_str(), stream);
      return own_dispatch_output();
    }
    auto need = [&](const std::optional<Array>& a, const char* name) -> void* {
      const int64_t bytes = epcomm::desc_bytes(descs_, name);
      if (bytes == 0) return nullptr;
      if (!a) invalid(c.op + ": out." + name + " is missing: give every output or none");
      check_out(c, (std::string("out.") + name).c_str(), *a, bytes);
      return a->data();
    };
    epcomm::DispatchOutput o;
    o.tokens = need(tokens, "tokens");
    o.row_offsets = static_cast<uint32_t*>(need(row_offsets, "row_offsets"));
    o.expert_ids = static_cast<int32_t*>(need(expert_ids, "expert_ids"));
    o.src_info = static_cast<epcomm::SrcInfo*>(need(src_info, "src_info"));
    o.scales = need(scales, "scales");
    o.scales_offsets = static_cast<uint32_t*>(need(scales_offsets, "scales_offsets"));
    o.counts = static_cast<int32_t*>(need(counts, "counts"));
    o.slot_token = static_cast<int32_t*>(need(slot_token, "slot_token"));
    o.layout_range = static_cast<int64_t*>(need(layout_range, "layout_range"));
    return o;
  }

  // The group's own outputs (in the padded layout, allocate_lazy first).
  epcomm::DispatchOutput own_dispatch_output() const {
    epcomm::DispatchOutput o;
    o.tokens = tokens_.ptr;
    o.row_offsets = static_cast<uint32_t*>(row_offsets_.ptr);
    o.expert_ids = static_cast<int32_t*>(expert_ids_.ptr);
    o.src_info = static_cast<epcomm::SrcInfo*>(src_info_.ptr);
    o.scales = scales_.ptr;
    o.scales_offsets = static_cast<uint32_t*>(scales_offsets_.ptr);
    o.counts = static_cast<int32_t*>(counts_.ptr);
    o.slot_token = static_cast<int32_t*>(slot_token_.ptr);
    o.layout_range = static_cast<int64_t*>(layout_range_.ptr);
    return o;
  }

  epcomm::DispatchInput dispatch_input(const Ctx& c, const Array& tokens, const Array& topk_ids,
                                       const std::optional<Array>& weights) const {
    const epcomm::Config& cfg = live()->config();
    check_array(c, "tokens", tokens, Elem::kBf16, {-1, cfg.hidden},
                "[T, hidden] (hidden from the config)");
    const int64_t T = int64_t(tokens.shape(0));
    if (T > cfg.max_tokens_per_rank)
      invalid(c.op + ": tokens has " + std::to_string(T) +
              " rows but the group was set up with "
              "max_tokens_per_rank = " +
              std::to_string(cfg.max_tokens_per_rank));
    // int32 or int64 ids (torch.topk's dtype), read by the kernel as they are.
    const bool wide =
        check_ids(c, "topk_ids", topk_ids, {T, cfg.top_k}, "[T, top_k], T = tokens.shape[0]");
    epcomm::DispatchInput in;
    in.tokens = present(tokens);
    if (wide)
      in.topk_ids64 = static_cast<const int64_t*>(present(topk_ids));
    else
      in.topk_ids = static_cast<const int32_t*>(present(topk_ids));
    in.num_tokens = int32_t(T);
    in.hidden = cfg.hidden;
    if (weights) {
      check_array(c, "weights", *weights, Elem::kF32, {T, cfg.top_k},
                  "[T, top_k], T = tokens.shape[0]");
      in.weights = static_cast<const float*>(present(*weights));
    }
    return in;
  }

  void dispatch(const Array& tokens, const Array& topk_ids, const std::optional<Array>& weights,
                uintptr_t stream, const std::optional<Array>& o_tokens,
                const std::optional<Array>& o_scales, const std::optional<Array>& o_row_offsets,
                const std::optional<Array>& o_expert_ids, const std::optional<Array>& o_src_info,
                const std::optional<Array>& o_scales_offsets, const std::optional<Array>& o_counts,
                const std::optional<Array>& o_slot_token,
                const std::optional<Array>& o_layout_range) {
    const Ctx c = ctx("dispatch");
    const epcomm::DispatchInput in = dispatch_input(c, tokens, topk_ids, weights);
    const epcomm::DispatchOutput out =
        dispatch_output(c, o_tokens, o_scales, o_row_offsets, o_expert_ids, o_src_info,
                        o_scales_offsets, o_counts, o_slot_token, o_layout_range, stream);
    DeviceGuard guard;
    {
      nb::gil_scoped_release nogil;
      live()->dispatch(in, out, as_stream(stream));
    }
  }

  void dispatch_async(const Array& tokens, const Array& topk_ids,
                      const std::optional<Array>& weights, uintptr_t stream) {
    const Ctx c = ctx("dispatch_async");
    const epcomm::DispatchInput in = dispatch_input(c, tokens, topk_ids, weights);
    DeviceGuard guard;
    {
      nb::gil_scoped_release nogil;
      live()->dispatch_async(in, as_stream(stream));
    }
  }

  void dispatch_wait(uintptr_t stream, const std::optional<Array>& o_tokens,
                     const std::optional<Array>& o_scales,
                     const std::optional<Array>& o_row_offsets,
                     const std::optional<Array>& o_expert_ids,
                     const std::optional<Array>& o_src_info,
                     const std::optional<Array>& o_scales_offsets,
                     const std::optional<Array>& o_counts, const std::optional<Array>& o_slot_token,
                     const std::optional<Array>& o_layout_range) {
    const Ctx c = ctx("dispatch_wait");
    const epcomm::DispatchOutput out =
        dispatch_output(c, o_tokens, o_scales, o_row_offsets, o_expert_ids, o_src_info,
                        o_scales_offsets, o_counts, o_slot_token, o_layout_range, stream);
    DeviceGuard guard;
    {
      nb::gil_scoped_release nogil;
      live()->dispatch_wait(out, as_stream(stream));
    }
  }

  // used_rows: the caller has read row_offsets[G] of the last dispatch from the device (after
  // it completed) and vouches that combine reads no row past it; -1: the host does not know it,
  // so expert_out must hold every row the dispatch output can have.
  epcomm::CombineInput combine_input(const Ctx& c, const Array& expert_out,
                                     const std::optional<Array>& row_offsets,
                                     const std::optional<Array>& src_info,
                                     int64_t used_rows) const {
    const epcomm::Config& cfg = live()->config();
    const epcomm::Sizes& s = live()->sizes();
    epcomm::CombineInput in;
    if (expert_out.ndim() == 3) {
      // The padded per-expert layout [G, capacity, hidden] (CombineInput::expert_out_capacity;
      // set-up checks the capacity).
      check_array(c, "expert_out", expert_out, Elem::kBf16, {s.num_groups, -1, -1},
                  "[G, capacity, hidden]: the padded per-expert layout");
      in.expert_out_capacity = int64_t(expert_out.shape(1));
      if (in.expert_out_capacity == 0)
        invalid(c.op + ": expert_out " + shape_str(expert_out) +
                " has no slots: the padded layout needs a capacity of at least the most rows "
                "a group can receive");
    } else {
      check_array(c, "expert_out", expert_out, Elem::kBf16, {-1, -1},
                  "[rows, hidden], rows >= the dispatch output's rows (sizes.max_recv_rows); "
                  "or [G, capacity, hidden], the padded per-expert layout");
    }
    // The columns combined: the group's hidden, or fewer (CombineInput::hidden).
    const int64_t h = int64_t(expert_out.shape(expert_out.ndim() - 1));
    if (!cfg.combine_columns_ok(h))
      invalid(c.op + ": expert_out " + shape_str(expert_out) + " has " + std::to_string(h) +
              " columns: the group's hidden (" + std::to_string(cfg.hidden) +
              ") or fewer, a positive multiple of 8");
    const int64_t need = used_rows >= 0 ? std::min(used_rows, s.max_recv_rows) : s.max_recv_rows;
    if (in.expert_out_capacity == 0 && int64_t(expert_out.shape(0)) < need)
      invalid(c.op + ": expert_out has " + std::to_string(expert_out.shape(0)) +
              " rows; it needs " +
              (used_rows >= 0 ? "the " + std::to_string(need) + " rows the dispatch produced"
                              : "the dispatch output's " + std::to_string(need) +
                                    " (sizes.max_recv_rows): combine reads rows up to "
                                    "row_offsets[G], which only the device knows"));
    if (bool(row_offsets) != bool(src_info))
      invalid(c.op +
              ": give both row_offsets and src_info (the dispatch output's), or neither "
              "(the group's own dispatch output)");
    in.expert_out = present(expert_out);
    in.hidden = int32_t(h);
    if (row_offsets) {
      check_array(c, "row_offsets", *row_offsets, Elem::kI32,
                  epcomm::find_desc(descs_, "row_offsets")->shape, "[G + 1]");
      check_out(c, "src_info", *src_info, epcomm::desc_bytes(descs_, "src_info"));
      in.row_offsets = static_cast<const uint32_t*>(row_offsets->data());
      in.src_info = static_cast<const epcomm::SrcInfo*>(src_info->data());
    } else {
      in.row_offsets = static_cast<const uint32_t*>(row_offsets_.ptr);
      in.src_info = static_cast<const epcomm::SrcInfo*>(src_info_.ptr);
    }
    return in;
  }

  // The combine output for the last dispatch, of `hidden` columns: the caller's `out` or the
  // group's buffer (which a combine of fewer columns than the group's does not take).
  epcomm::CombineOutput combine_output(const Ctx& c, const std::optional<Array>& weights,
                                       const std::optional<Array>& out, uintptr_t stream,
                                       int32_t hidden) {
    const epcomm::Config& cfg = live()->config();
    const epcomm::DispatchRecord last = live()->last_dispatch();
    if (last.num_tokens < 0) invalid(c.op + ": no dispatch has completed on this group yet");
    const int64_t T = last.num_tokens;
    epcomm::CombineOutput o;
    if (weights) {
      if (last.weights)
        invalid(c.op +
                ": the last dispatch carried router weights, so combine reduces with "
                "those on the expert side: pass weights=None");
      check_array(c, "weights", *weights, Elem::kF32, {T, cfg.top_k},
                  "[T, top_k] for the T tokens of the last dispatch");
      o.weights = static_cast<const float*>(present(*weights));
    }
    const bool reduced = weights || last.weights;
    if (hidden <= 0) hidden = cfg.hidden;
    if (!out && hidden != cfg.hidden)
      invalid(c.op + ": a combine of " + std::to_string(hidden) +
              " columns, fewer than the group's hidden (" + std::to_string(cfg.hidden) +
              "), needs out= (its group buffer is the group's width)");
    if (out) {
      check_array(c, "out", *out, Elem::kBf16,
                  epcomm::combine_output_desc(cfg, int32_t(T), reduced, hidden).shape,
                  reduced ? "[T, hidden] for the T tokens of the last dispatch (hidden: "
                            "expert_out's columns)"
                          : "[T, top_k, hidden] (no router weights: the un-reduced rows)");
      o.out = const_cast<void*>(present(*out));  // T = 0: a null tensor is fine
    } else if (reduced) {
      o.out = out_.ptr;
    } else {
      o.out = unreduced_buffer(c, stream);
    }
    return o;
  }

  void* unreduced_buffer(const Ctx& c, uintptr_t stream) {
    if (!unreduced_.ptr) {
      cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
      cuda_check(cudaStreamIsCapturing(as_stream(stream), &st), "cudaStreamIsCapturing");
      if (st != cudaStreamCaptureStatusNone)
        invalid(c.op +
                ": the un-reduced [T, top_k, hidden] output is allocated at its first "
                "use, which cannot happen during graph capture: run one un-reduced combine "
                "before capturing, or pass out=");
      const epcomm::Config& cfg = live()->config();
      DeviceGuard guard;
      cuda_check(cudaSetDevice(live()->device()), "cudaSetDevice");
      unreduced_.allocate(live()->device(),
                          epcomm::combine_output_desc(cfg, cfg.max_tokens_per_rank, false).bytes());
    }
    return unreduced_.ptr;
  }

  // Returns whether the output is reduced ([T, H]) and T.
  nb::tuple combine(const Array& expert_out, const std::optional<Array>& weights, uintptr_t stream,
                    const std::optional<Array>& out, const std::optional<Array>& row_offsets,
                    const std::optional<Array>& src_info, int64_t used_rows) {
    const Ctx c = ctx("combine");
    const epcomm::CombineInput in = combine_input(c, expert_out, row_offsets, src_info, used_rows);
    const epcomm::CombineOutput o = combine_output(c, weights, out, stream, in.hidden);
    DeviceGuard guard;
    {
      nb::gil_scoped_release nogil;
      live()->combine(in, o, as_stream(stream));
    }
    return nb::make_tuple(o.weights != nullptr || last_weighted(), last_tokens());
  }

  void combine_async(const Array& expert_out, uintptr_t stream,
                     const std::optional<Array>& row_offsets,
                     const std::optional<Array>& src_info, int64_t used_rows) {
    const Ctx c = ctx("combine_async");
    const epcomm::CombineInput in = combine_input(c, expert_out, row_offsets, src_info, used_rows);
    DeviceGuard guard;
    nb::gil_scoped_release nogil;
    live()->combine_async(in, as_stream(stream));
  }

  nb::tuple combine_wait(const std::optional<Array>& weights, uintptr_t stream,
                         const std::optional<Array>& out) {
    const Ctx c = ctx("combine_wait");
    const epcomm::CombineOutput o =
        combine_output(c, weights, out, stream, live()->pending_combine_columns());
    DeviceGuard guard;
    {
      nb::gil_scoped_release nogil;
      live()->combine_wait(o, as_stream(stream));
    }
    return nb::make_tuple(o.weights != nullptr || last_weighted(), last_tokens());
  }

  // One of the group's buffers as an array (no framework: the Python side converts it once
  // through DLPack). The element types are the plain ones every framework has; python/epcomm
  // views the codes as float8 where the framework has it.
  // plain: bfloat16 buffers as uint16 (for frameworks without bfloat16).
  Array buffer(const std::string& name, bool plain, nb::handle owner) {
    const epcomm::Config& c = live()->config();
    auto make = [&](const DeviceBuffer& b, const epcomm::TensorDesc& d) {
      const std::vector<size_t> shape(d.shape.begin(), d.shape.end());
      return Array(b.ptr, shape.size(), shape.data(), owner, nullptr, dlpack_dtype(d.dtype, plain),
                   nb::device::cuda::value, live()->device());
    };
    if (const epcomm::TensorDesc* d = epcomm::find_desc(descs_, name)) {
      if (lazy(name)) allocate_lazy("epcomm buffer", std::nullopt);
      return make(dispatch_buffer(name), *d);
    }
    if (name == "out")
      return make(out_, epcomm::combine_output_desc(c, c.max_tokens_per_rank, true));
    if (name == "out_unreduced") {
      unreduced_buffer(ctx("combine"), 0);
      return make(unreduced_, epcomm::combine_output_desc(c, c.max_tokens_per_rank, false));
    }
    invalid("epcomm: no buffer named '" + name + "'");
  }

  // ---- the DeepEP layer's low-latency calls (python/epcomm/deep_ep.py) ------------------------
  // Device pointers as integers: the layer has checked every tensor's dtype, shape, device and
  // contiguity, and allocated the outputs, before it calls; converting its ~10 tensors through
  // DLPack cost more host time than the rest of the call. The library still checks each
  // pointer (null, alignment) before any launch.
  //
  // Streams: the work runs on `comm` after what `compute` has queued (an event between them
  // where they differ), and with `join` `compute` then waits for it, as DeepEP's calls do.
  // send_only (the receive hook): only the send half runs; ll_receive / ll_combine_wait finish.
  struct LlOutputs {  // the padded per-expert outputs ([E_l, S, ...]; DeepEP's layout)
    uintptr_t codes, scales, count, slot_token, layout_range;  // scales: fp32 or UE8M0 words
  };

  // The dispatch, writing DeepEP's padded layout itself (the group has Config::padded_capacity
  // = S); send_only: its send half, and ll_receive is the hook's receive half.
  void ll_dispatch(uintptr_t x, int64_t T, uintptr_t ids, int32_t id_bytes, const LlOutputs& o,
                   uintptr_t compute, uintptr_t comm, bool join, bool send_only) {
    const epcomm::Config& cfg = live()->config();
    epcomm::DispatchInput in;
    if (id_bytes != 4 && id_bytes != 8)
      invalid("ll_dispatch: id_bytes = " + std::to_string(id_bytes) + " (4: int32, 8: int64)");
    // T = 0: the pointers are never read, and a null one stands for the group's buffer; with
    // tokens, a null one stays null, and the core refuses it.
    const uintptr_t none = T == 0 ? uintptr_t(out_.ptr) : 0;
    in.tokens = reinterpret_cast<const void*>(x ? x : none);
    if (id_bytes == 8)
      in.topk_ids64 = reinterpret_cast<const int64_t*>(ids ? ids : none);
    else
      in.topk_ids = reinterpret_cast<const int32_t*>(ids ? ids : none);
    in.num_tokens = int32_t(T);
    in.hidden = cfg.hidden;
    on_comm(
        compute, comm, join, send_only, [&](cudaStream_t s) { live()->dispatch_async(in, s); },
        [&](cudaStream_t s) { live()->dispatch(in, ll_output(o), s); });
  }

  // The receive half of a send_only ll_dispatch, on `stream`.
  void ll_receive(const LlOutputs& o, uintptr_t stream) {
    DeviceGuard guard;
    nb::gil_scoped_release nogil;
    cuda_check(cudaSetDevice(live()->device()), "cudaSetDevice");
    live()->dispatch_wait(ll_output(o), as_stream(stream));
  }

  // expert_out: the padded [E_l, capacity, H] bf16 outputs; weights [T, K] fp32; out [T, H].
  void ll_combine(uintptr_t expert_out, int64_t capacity, uintptr_t weights, uintptr_t out,
                  uintptr_t compute, uintptr_t comm, bool join, bool send_only) {
    epcomm::CombineInput in;
    in.expert_out = reinterpret_cast<const void*>(expert_out);
    in.expert_out_capacity = capacity;
    in.row_offsets = static_cast<const uint32_t*>(row_offsets_.ptr);
    in.src_info = static_cast<const epcomm::SrcInfo*>(src_info_.ptr);
    in.hidden = live()->config().hidden;
    on_comm(
        compute, comm, join, send_only, [&](cudaStream_t s) { live()->combine_async(in, s); },
        [&](cudaStream_t s) { live()->combine(in, ll_combine_output(weights, out), s); });
  }

  void ll_combine_wait(uintptr_t weights, uintptr_t out, uintptr_t stream) {
    DeviceGuard guard;
    nb::gil_scoped_release nogil;
    cuda_check(cudaSetDevice(live()->device()), "cudaSetDevice");
    live()->combine_wait(ll_combine_output(weights, out), as_stream(stream));
  }

  ~PyGroup() {
    DeviceGuard guard;
    if (stream_event_ && cudaSetDevice(event_device_) == cudaSuccess)
      (void)cudaEventDestroy(stream_event_);
  }

  int32_t last_tokens() const { return live()->last_dispatch().num_tokens; }
  bool last_weighted() const { return live()->last_dispatch().weights; }

 private:
  // The element type a description's tensor crosses DLPack as: the plain types every framework
  // has (python/epcomm views e4m3 codes as float8 where the framework has it).
  static nb::dlpack::dtype dlpack_dtype(epcomm::DType t, bool plain) {
    switch (t) {
      case epcomm::DType::kBF16:
        return plain ? nb::dtype<uint16_t>()
                     : nb::dlpack::dtype{uint8_t(nb::dlpack::dtype_code::Bfloat), 16, 1};
      case epcomm::DType::kF32:
        return nb::dtype<float>();
      case epcomm::DType::kI32:
        return nb::dtype<int32_t>();
      case epcomm::DType::kI64:
        return nb::dtype<int64_t>();
      case epcomm::DType::kU8:
      case epcomm::DType::kFloat8E4M3:
        break;
    }
    return nb::dtype<uint8_t>();
  }
  // The group's buffer of the dispatch output named `name` (a name of dispatch_output_descs).
  DeviceBuffer& dispatch_buffer(const std::string& name) {
    if (name == "tokens") return tokens_;
    if (name == "scales") return scales_;
    if (name == "row_offsets") return row_offsets_;
    if (name == "expert_ids") return expert_ids_;
    if (name == "src_info") return src_info_;
    if (name == "scales_offsets") return scales_offsets_;
    if (name == "counts") return counts_;
    if (name == "slot_token") return slot_token_;
    if (name == "layout_range") return layout_range_;
    invalid("epcomm: no dispatch output named '" + name + "'");
  }

  epcomm::Group* live() const {
    if (!g_) invalid("epcomm: this group was closed");
    return g_.get();
  }

  // A low-latency call's work on `comm`, after what `compute` has queued: its send half alone
  // (send_only), or the whole call, which `compute` then waits for with `join` (a flag: a stream
  // handle of 0 is the default stream).
  template <class Half, class Whole>
  void on_comm(uintptr_t compute, uintptr_t comm, bool join, bool send_only, Half half,
               Whole whole) {
    DeviceGuard guard;
    nb::gil_scoped_release nogil;
    cuda_check(cudaSetDevice(live()->device()), "cudaSetDevice");
    fork(compute, comm);
    if (send_only) {
      half(as_stream(comm));
      return;
    }
    whole(as_stream(comm));
    if (join) fork(comm, compute);
  }

  // `to` waits for the work queued on `from` so far (nothing where they are one stream). One
  // event serves every call: a wait takes the event's state when it is queued.
  void fork(uintptr_t from, uintptr_t to) {
    if (from == to) return;
    if (!stream_event_) {
      cuda_check(cudaEventCreateWithFlags(&stream_event_, cudaEventDisableTiming),
                 "cudaEventCreateWithFlags");
      event_device_ = live()->device();
    }
    cuda_check(cudaEventRecord(stream_event_, as_stream(from)), "cudaEventRecord");
    cuda_check(cudaStreamWaitEvent(as_stream(to), stream_event_, 0), "cudaStreamWaitEvent");
  }

  // The low-latency dispatch's outputs: the caller's padded tokens, scales, counts, slot_token
  // and layout_range; the group's own packed rows (row_offsets, expert_ids, src_info: what its
  // combine reads).
  epcomm::DispatchOutput ll_output(const LlOutputs& o) const {
    epcomm::DispatchOutput d = own_dispatch_output();
    d.tokens = reinterpret_cast<void*>(o.codes);
    d.scales = reinterpret_cast<void*>(o.scales);
    d.counts = reinterpret_cast<int32_t*>(o.count);
    d.slot_token = reinterpret_cast<int32_t*>(o.slot_token);
    d.layout_range = reinterpret_cast<int64_t*>(o.layout_range);
    return d;
  }

  epcomm::CombineOutput ll_combine_output(uintptr_t weights, uintptr_t out) const {
    // T = 0 may come with null pointers; a null weights pointer would mean "no weights".
    epcomm::CombineOutput o;
    o.weights = reinterpret_cast<const float*>(weights ? weights : uintptr_t(out_.ptr));
    o.out = out ? reinterpret_cast<void*>(out) : out_.ptr;
    return o;
  }

  cudaEvent_t stream_event_ = nullptr;
  int event_device_ = 0;
  std::unique_ptr<epcomm::Group> g_;
  std::vector<epcomm::TensorDesc> descs_;  // the dispatch outputs (epcomm/tensors.h)
  DeviceBuffer tokens_, scales_, row_offsets_, expert_ids_, src_info_, scales_offsets_, counts_,
      slot_token_, layout_range_, out_, unreduced_;
  bool padded_own_ = false;  // allocate_lazy has run
};

}  // namespace

void bind_group(nb::module_& m) {
  nb::class_<PyGroup>(m, "Group", "One rank of an expert-parallel group (epcomm/group.h).")
      .def_static(
          "create",
          [](const epcomm::Config& cfg, epcomm::Bootstrap& bs, int device) {
            std::unique_ptr<epcomm::Group> g;
            {
              DeviceGuard guard;
              nb::gil_scoped_release nogil;
              g = epcomm::Group::create(cfg, bs, device);
            }
            return new PyGroup(std::move(g));
          },
          "config"_a, "bootstrap"_a, "device"_a, nb::rv_policy::take_ownership,
          nb::keep_alive<0, 2>())  // the group uses its bootstrap until it is destroyed
      .def_static(
          "create_local",
          [](const epcomm::Config& cfg, std::vector<int> devices) {
            std::vector<std::unique_ptr<epcomm::Group>> gs;
            {
              DeviceGuard guard;
              nb::gil_scoped_release nogil;
              gs = epcomm::Group::create_local(cfg, devices);
            }
            nb::list out;
            for (auto& g : gs)
              out.append(nb::cast(new PyGroup(std::move(g)), nb::rv_policy::take_ownership));
            return out;
          },
          "config"_a, "devices"_a = std::vector<int>{})
      .def_prop_ro("rank", [](const PyGroup& g) { return g.g().rank(); })
      .def_prop_ro("n_ranks", [](const PyGroup& g) { return g.g().n_ranks(); })
      .def_prop_ro("device", [](const PyGroup& g) { return g.g().device(); })
      .def_prop_ro("config", [](const PyGroup& g) { return g.g().config(); })
      .def_prop_ro("sizes", [](const PyGroup& g) { return g.g().sizes(); })
      .def_prop_ro("poisoned", [](const PyGroup& g) { return g.g().poisoned(); })
      .def_prop_ro("last_tokens", &PyGroup::last_tokens)
      .def_prop_ro("last_weighted", &PyGroup::last_weighted)
      .def("check", [](PyGroup& g) { g.g().check(); })
      .def("close", &PyGroup::close)
      .def_prop_ro("closed", &PyGroup::closed)
      .def(
          "synchronize",
          [](PyGroup& g, uintptr_t stream) {
            DeviceGuard guard;
            nb::gil_scoped_release nogil;
            g.g().synchronize(as_stream(stream));
          },
          "stream"_a)
      .def("dispatch", &PyGroup::dispatch, "tokens"_a, "topk_ids"_a, "weights"_a.none(), "stream"_a,
           "out_tokens"_a.none() = nb::none(), "out_scales"_a.none() = nb::none(),
           "out_row_offsets"_a.none() = nb::none(), "out_expert_ids"_a.none() = nb::none(),
           "out_src_info"_a.none() = nb::none(), "out_scales_offsets"_a.none() = nb::none(),
           "out_counts"_a.none() = nb::none(), "out_slot_token"_a.none() = nb::none(),
           "out_layout_range"_a.none() = nb::none())
      .def("dispatch_async", &PyGroup::dispatch_async, "tokens"_a, "topk_ids"_a, "weights"_a.none(),
           "stream"_a)
      .def("dispatch_wait", &PyGroup::dispatch_wait, "stream"_a, "out_tokens"_a.none() = nb::none(),
           "out_scales"_a.none() = nb::none(), "out_row_offsets"_a.none() = nb::none(),
           "out_expert_ids"_a.none() = nb::none(), "out_src_info"_a.none() = nb::none(),
           "out_scales_offsets"_a.none() = nb::none(), "out_counts"_a.none() = nb::none(),
           "out_slot_token"_a.none() = nb::none(), "out_layout_range"_a.none() = nb::none())
      .def("combine", &PyGroup::combine, "expert_out"_a, "weights"_a.none(), "stream"_a,
           "out"_a.none() = nb::none(), "row_offsets"_a.none() = nb::none(),
           "src_info"_a.none() = nb::none(), "used_rows"_a = -1)
      .def("combine_async", &PyGroup::combine_async, "expert_out"_a, "stream"_a,
           "row_offsets"_a.none() = nb::none(), "src_info"_a.none() = nb::none(),
           "used_rows"_a = -1)
      .def("combine_wait", &PyGroup::combine_wait, "weights"_a.none(), "stream"_a,
           "out"_a.none() = nb::none())
      .def(
          "ll_dispatch",
          [](PyGroup& g, uintptr_t x, int64_t T, uintptr_t ids, int32_t id_bytes, uintptr_t codes,
             uintptr_t scales, uintptr_t count, uintptr_t slot_token, uintptr_t layout_range,
             uintptr_t compute, uintptr_t comm, bool join, bool send_only) {
            g.ll_dispatch(x, T, ids, id_bytes, {codes, scales, count, slot_token, layout_range},
                          compute, comm, join, send_only);
          },
          "x"_a, "num_tokens"_a, "topk_ids"_a, "id_bytes"_a, "codes"_a, "scales"_a, "count"_a,
          "slot_token"_a, "layout_range"_a, "compute"_a, "comm"_a, "join"_a, "send_only"_a,
          "The DeepEP layer's low-latency dispatch into its padded layout (device pointers as "
          "integers).")
      .def(
          "ll_receive",
          [](PyGroup& g, uintptr_t codes, uintptr_t scales, uintptr_t count, uintptr_t slot_token,
             uintptr_t layout_range, uintptr_t stream) {
            g.ll_receive({codes, scales, count, slot_token, layout_range}, stream);
          },
          "codes"_a, "scales"_a, "count"_a, "slot_token"_a, "layout_range"_a, "stream"_a)
      .def("ll_combine", &PyGroup::ll_combine, "expert_out"_a, "capacity"_a, "weights"_a, "out"_a,
           "compute"_a, "comm"_a, "join"_a, "send_only"_a)
      .def("ll_combine_wait", &PyGroup::ll_combine_wait, "weights"_a, "out"_a, "stream"_a)
      .def(
          "buffer",
          [](nb::handle self, const std::string& name, bool plain) {
            return nb::cast<PyGroup&>(self).buffer(name, plain, self);
          },
          "name"_a, "plain"_a = false);
}

}  // namespace epcomm_py
