// epcomm._epcomm: the nanobind module under the Python package (python/epcomm). It binds the
// C++ API one to one and checks every array argument (dtype, shape, device, contiguity) with a
// message that names the call, the rank and the argument; python/epcomm/__init__.py adds the
// framework side (current streams, output tensors of the caller's framework, torch.distributed).
//
// Arrays cross as DLPack (nb::ndarray<>), so any framework's tensors are accepted. Streams cross
// as integers (cudaStream_t). Every call that launches work restores the caller's current device.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "epcomm/bootstrap.h"
#include "epcomm/config.h"
#include "epcomm/error.h"
#include "epcomm/formats/reference_codecs.h"
#include "epcomm/formats/scale_layouts.h"
#include "epcomm/group.h"
#include "epcomm/padded_layout.h"
#include "epcomm/reference.h"
#include "epcomm/silu.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using Array = nb::ndarray<>;
using epcomm::Error;
using epcomm::ErrorCode;

[[noreturn]] void invalid(const std::string& what) {
  throw Error(ErrorCode::kInvalidArgument, what);
}
void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(ErrorCode::kCuda, std::string(what) + ": " + cudaGetErrorString(e));
}

// ---- array checks ------------------------------------------------------------------------------

// The element types the API takes. kBytes: any 1-byte type (uint8, int8, float8 variants).
enum class Elem { kBf16, kF32, kI32, kI64, kBytes };

const char* elem_name(Elem e) {
  switch (e) {
    case Elem::kBf16:
      return "bfloat16 (or uint16 holding bfloat16 bits)";
    case Elem::kF32:
      return "float32";
    case Elem::kI32:
      return "int32";
    case Elem::kI64:
      return "int64";
    case Elem::kBytes:
      return "a 1-byte type (uint8 / int8 / float8)";
  }
  return "?";
}

bool elem_matches(const nb::dlpack::dtype& d, Elem e) {
  using C = nb::dlpack::dtype_code;
  if (d.lanes != 1) return false;
  switch (e) {
    case Elem::kBf16:  // bfloat16, or uint16 bit patterns (frameworks without bfloat16: CuPy)
      return (d.code == uint8_t(C::Bfloat) || d.code == uint8_t(C::UInt)) && d.bits == 16;
    case Elem::kF32:
      return d.code == uint8_t(C::Float) && d.bits == 32;
    case Elem::kI32:
      return d.code == uint8_t(C::Int) && d.bits == 32;
    case Elem::kI64:
      return d.code == uint8_t(C::Int) && d.bits == 64;
    case Elem::kBytes:
      return d.bits == 8;
  }
  return false;
}

std::string dtype_name(const nb::dlpack::dtype& d) {
  using C = nb::dlpack::dtype_code;
  std::string base;
  switch (d.code) {
    case uint8_t(C::Int):
      base = "int";
      break;
    case uint8_t(C::UInt):
      base = "uint";
      break;
    case uint8_t(C::Float):
      base = "float";
      break;
    case uint8_t(C::Bfloat):
      base = "bfloat";
      break;
    case uint8_t(C::Complex):
      base = "complex";
      break;
    case uint8_t(C::Bool):
      base = "bool";
      break;
    default:
      base = "dtype-code-" + std::to_string(int(d.code)) + "-bits-";
      break;
  }
  return base + std::to_string(int(d.bits));
}

std::string shape_str(const Array& a) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < a.ndim(); ++i)
    os << (i ? ", " : "") << a.shape(i);
  os << "]";
  return os.str();
}

std::string device_str(const Array& a) {
  switch (a.device_type()) {
    case nb::device::cpu::value:
      return "cpu";
    case nb::device::cuda::value:
      return "cuda:" + std::to_string(a.device_id());
    case nb::device::cuda_host::value:
      return "cuda pinned host memory";
    case nb::device::cuda_managed::value:
      return "cuda managed memory";
    default:
      return "device type " + std::to_string(a.device_type());
  }
}

bool c_contiguous(const Array& a) {
  for (size_t i = 0; i < a.ndim(); ++i)
    if (a.shape(i) == 0) return true;  // no elements: any strides do
  int64_t expect = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expect) return false;
    expect *= int64_t(a.shape(i));
  }
  return true;
}

// Where a check runs: "epcomm dispatch (rank 2)" and the device the arrays must be on.
struct Ctx {
  std::string op;
  int device;
};

// In this order: element type, shape (a dimension of -1 matches any size), contiguity, device.
void check_array(const Ctx& c, const char* name, const Array& a, Elem elem,
                 std::initializer_list<int64_t> shape, const char* shape_doc) {
  const std::string who = c.op + ": " + name;
  if (!elem_matches(a.dtype(), elem)) {
    std::string hint;
    if (elem == Elem::kI32 && a.dtype().code == uint8_t(nb::dlpack::dtype_code::Int) &&
        a.dtype().bits == 64)
      hint = " (torch.topk gives int64 indices: pass ids.to(torch.int32))";
    invalid(who + " must be " + elem_name(elem) + "; got " + dtype_name(a.dtype()) + hint);
  }
  bool ok = a.ndim() == shape.size();
  size_t i = 0;
  for (int64_t s : shape) {
    if (ok && s >= 0 && int64_t(a.shape(i)) != s) ok = false;
    ++i;
  }
  if (!ok) invalid(who + " must have shape " + shape_doc + "; got " + shape_str(a));
  if (!c_contiguous(a)) invalid(who + " must be contiguous (row-major); call .contiguous()");
  if (a.device_type() != nb::device::cuda::value)
    invalid(who + " must be a CUDA tensor on cuda:" + std::to_string(c.device) + "; got " +
            device_str(a) + " memory");
  if (a.device_id() != c.device)
    invalid(who + " is on cuda:" + std::to_string(a.device_id()) +
            " but the call runs on cuda:" + std::to_string(c.device));
}

// An output buffer given by the caller: contiguous CUDA memory on the device, at least `bytes`.
void check_out(const Ctx& c, const char* name, const Array& a, int64_t bytes) {
  const std::string who = c.op + ": " + name;
  if (a.device_type() != nb::device::cuda::value || a.device_id() != c.device)
    invalid(who + " must be a CUDA tensor on cuda:" + std::to_string(c.device) + "; got " +
            device_str(a) + " memory");
  if (!c_contiguous(a)) invalid(who + " must be contiguous");
  if (int64_t(a.nbytes()) < bytes)
    invalid(who + " holds " + std::to_string(a.nbytes()) + " bytes; it needs at least " +
            std::to_string(bytes));
}

// The caller's current device is restored when a call returns (the library selects the
// group's device to launch).
struct DeviceGuard {
  int prev = -1;
  DeviceGuard() { (void)cudaGetDevice(&prev); }
  ~DeviceGuard() {
    if (prev >= 0) (void)cudaSetDevice(prev);
  }
};

cudaStream_t as_stream(uintptr_t s) {
  return reinterpret_cast<cudaStream_t>(s);
}

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

// ---- bootstrap from a Python callable ----------------------------------------------------------

// all_gather(bytes) -> bytes of size * len, or a list of `size` bytes objects (rank order).
class CallbackBootstrap : public epcomm::Bootstrap {
 public:
  CallbackBootstrap(int rank, int size, nb::callable fn) : rank_(rank), size_(size), fn_(fn) {
    if (size < 1 || rank < 0 || rank >= size)
      invalid("epcomm bootstrap: rank " + std::to_string(rank) + " of size " +
              std::to_string(size) + " is out of range");
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void all_gather(const void* send, void* recv, size_t bytes) override {
    nb::gil_scoped_acquire gil;
    const std::string where = "epcomm bootstrap (rank " + std::to_string(rank_) + "): ";
    std::string failure;
    if (!fn_.is_valid()) throw Error(ErrorCode::kBootstrap, where + "the callback was cleared");
      // A group garbage-collected while the interpreter shuts down must not call back into
      // frameworks that may already be torn down: its teardown then skips the peer barrier.
#if PY_VERSION_HEX >= 0x030D0000
    if (Py_IsFinalizing())
#else
    if (_Py_IsFinalizing())
#endif
      throw Error(ErrorCode::kBootstrap, where + "the interpreter is shutting down");
    try {
      nb::object r = fn_(nb::bytes(static_cast<const char*>(send), bytes));
      auto* out = static_cast<char*>(recv);
      if (nb::isinstance<nb::bytes>(r)) {
        nb::bytes b = nb::borrow<nb::bytes>(r);
        if (b.size() != bytes * size_t(size_))
          failure = "the all_gather callback returned " + std::to_string(b.size()) +
                    " bytes; expected " + std::to_string(size_) + " x " + std::to_string(bytes);
        else
          std::memcpy(out, b.c_str(), b.size());
      } else if (nb::isinstance<nb::list>(r) || nb::isinstance<nb::tuple>(r)) {
        nb::sequence seq = nb::borrow<nb::sequence>(r);
        if (nb::len(seq) != size_t(size_))
          failure = "the all_gather callback returned " + std::to_string(nb::len(seq)) +
                    " entries; expected one per rank (" + std::to_string(size_) + ")";
        for (size_t i = 0; failure.empty() && i < size_t(size_); ++i) {
          nb::object e = seq[i];
          if (!nb::isinstance<nb::bytes>(e)) {
            failure = "entry " + std::to_string(i) +
                      " of the all_gather callback's result "
                      "is not bytes";
            break;
          }
          nb::bytes b = nb::borrow<nb::bytes>(e);
          if (b.size() != bytes) {
            failure = "entry " + std::to_string(i) + " holds " + std::to_string(b.size()) +
                      " bytes; every rank sends " + std::to_string(bytes);
            break;
          }
          std::memcpy(out + i * bytes, b.c_str(), bytes);
        }
      } else {
        failure = "the all_gather callback must return bytes or a list of bytes";
      }
    } catch (nb::python_error& e) {
      failure = std::string("the all_gather callback raised ") +
                nb::str(e.type().attr("__name__")).c_str() + ": " + nb::str(e.value()).c_str();
    }
    if (!failure.empty()) throw Error(ErrorCode::kBootstrap, where + failure);
  }

  // For Python's garbage collector: the callable may refer back to this object (a closure
  // over the variable that holds it).
  static int tp_traverse(PyObject* self, visitproc visit, void* arg) {
    Py_VISIT(Py_TYPE(self));
    if (!nb::inst_ready(self)) return 0;
    Py_VISIT(nb::inst_ptr<CallbackBootstrap>(self)->fn_.ptr());
    return 0;
  }
  static int tp_clear(PyObject* self) {
    nb::inst_ptr<CallbackBootstrap>(self)->fn_.reset();
    return 0;
  }

 private:
  int rank_;
  int size_;
  nb::callable fn_;
};

PyType_Slot callback_bootstrap_slots[] = {
    {Py_tp_traverse, reinterpret_cast<void*>(CallbackBootstrap::tp_traverse)},
    {Py_tp_clear, reinterpret_cast<void*>(CallbackBootstrap::tp_clear)},
    {0, nullptr}};

// ---- the group ---------------------------------------------------------------------------------

// A Group and the output buffers the Python API reuses call after call (allocated at set-up on
// the group's device; the un-reduced [T, K, H] combine output at its first use).
class PyGroup {
 public:
  explicit PyGroup(std::unique_ptr<epcomm::Group> g) : g_(std::move(g)) {
    if (!g_) invalid("epcomm: no group");
    DeviceGuard guard;
    cuda_check(cudaSetDevice(live()->device()), "epcomm: cudaSetDevice");
    const epcomm::Sizes& s = live()->sizes();
    const epcomm::Config& c = live()->config();
    const int d = live()->device();
    tokens_.allocate(d, s.max_recv_rows * s.token_bytes);
    scales_.allocate(d, s.scales_bytes);
    row_offsets_.allocate(d, int64_t(s.num_groups + 1) * 4);
    expert_ids_.allocate(d, int64_t(s.num_groups) * 4);
    src_info_.allocate(d, s.max_recv_rows * int64_t(sizeof(epcomm::SrcInfo)));
    scales_offsets_.allocate(d, int64_t(s.num_scales_offsets) * 4);
    out_.allocate(d, int64_t(c.max_tokens_per_rank) * c.hidden * 2);
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
  epcomm::DispatchOutput dispatch_output(const Ctx& c, const std::optional<Array>& tokens,
                                         const std::optional<Array>& scales,
                                         const std::optional<Array>& row_offsets,
                                         const std::optional<Array>& expert_ids,
                                         const std::optional<Array>& src_info,
                                         const std::optional<Array>& scales_offsets) {
    const epcomm::Sizes& s = live()->sizes();
    const bool any = tokens || scales || row_offsets || expert_ids || src_info || scales_offsets;
    if (!any)
      return epcomm::DispatchOutput{tokens_.ptr,
                                    static_cast<uint32_t*>(row_offsets_.ptr),
                                    static_cast<int32_t*>(expert_ids_.ptr),
                                    static_cast<epcomm::SrcInfo*>(src_info_.ptr),
                                    scales_.ptr,
                                    static_cast<uint32_t*>(scales_offsets_.ptr)};
    auto need = [&](const std::optional<Array>& a, const char* name, int64_t bytes) -> void* {
      if (bytes == 0) return nullptr;
      if (!a) invalid(c.op + ": out." + name + " is missing: give every output or none");
      check_out(c, (std::string("out.") + name).c_str(), *a, bytes);
      return a->data();
    };
    epcomm::DispatchOutput o;
    o.tokens = need(tokens, "tokens", s.max_recv_rows * s.token_bytes);
    o.row_offsets =
        static_cast<uint32_t*>(need(row_offsets, "row_offsets", int64_t(s.num_groups + 1) * 4));
    o.expert_ids = static_cast<int32_t*>(need(expert_ids, "expert_ids", int64_t(s.num_groups) * 4));
    o.src_info = static_cast<epcomm::SrcInfo*>(
        need(src_info, "src_info", s.max_recv_rows * int64_t(sizeof(epcomm::SrcInfo))));
    o.scales = need(scales, "scales", s.scales_bytes);
    o.scales_offsets = static_cast<uint32_t*>(
        need(scales_offsets, "scales_offsets", int64_t(s.num_scales_offsets) * 4));
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
    check_array(c, "topk_ids", topk_ids, Elem::kI32, {T, cfg.top_k},
                "[T, top_k], T = tokens.shape[0]");
    epcomm::DispatchInput in;
    in.tokens = present(tokens);
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
                const std::optional<Array>& o_scales_offsets) {
    const Ctx c = ctx("dispatch");
    const epcomm::DispatchInput in = dispatch_input(c, tokens, topk_ids, weights);
    const epcomm::DispatchOutput out = dispatch_output(c, o_tokens, o_scales, o_row_offsets,
                                                       o_expert_ids, o_src_info, o_scales_offsets);
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
                     const std::optional<Array>& o_scales_offsets) {
    const Ctx c = ctx("dispatch_wait");
    const epcomm::DispatchOutput out = dispatch_output(c, o_tokens, o_scales, o_row_offsets,
                                                       o_expert_ids, o_src_info, o_scales_offsets);
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
    check_array(c, "expert_out", expert_out, Elem::kBf16, {-1, cfg.hidden},
                "[rows, hidden], rows >= the dispatch output's rows (sizes.max_recv_rows)");
    const int64_t need = used_rows >= 0 ? std::min(used_rows, s.max_recv_rows) : s.max_recv_rows;
    if (int64_t(expert_out.shape(0)) < need)
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
    epcomm::CombineInput in;
    in.expert_out = present(expert_out);
    in.hidden = cfg.hidden;
    if (row_offsets) {
      check_array(c, "row_offsets", *row_offsets, Elem::kI32, {s.num_groups + 1}, "[G + 1]");
      check_out(c, "src_info", *src_info, s.max_recv_rows * int64_t(sizeof(epcomm::SrcInfo)));
      in.row_offsets = static_cast<const uint32_t*>(row_offsets->data());
      in.src_info = static_cast<const epcomm::SrcInfo*>(src_info->data());
    } else {
      in.row_offsets = static_cast<const uint32_t*>(row_offsets_.ptr);
      in.src_info = static_cast<const epcomm::SrcInfo*>(src_info_.ptr);
    }
    return in;
  }

  // The combine output for the last dispatch: the caller's `out` or the group's buffer.
  epcomm::CombineOutput combine_output(const Ctx& c, const std::optional<Array>& weights,
                                       const std::optional<Array>& out, uintptr_t stream) {
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
    if (out) {
      if (reduced)
        check_array(c, "out", *out, Elem::kBf16, {T, cfg.hidden},
                    "[T, hidden] for the T tokens of the last dispatch");
      else
        check_array(c, "out", *out, Elem::kBf16, {T, cfg.top_k, cfg.hidden},
                    "[T, top_k, hidden] (no router weights: the un-reduced rows)");
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
                          int64_t(cfg.max_tokens_per_rank) * cfg.top_k * cfg.hidden * 2);
    }
    return unreduced_.ptr;
  }

  // Returns whether the output is reduced ([T, H]) and T.
  nb::tuple combine(const Array& expert_out, const std::optional<Array>& weights, uintptr_t stream,
                    const std::optional<Array>& out, const std::optional<Array>& row_offsets,
                    const std::optional<Array>& src_info, int64_t used_rows) {
    const Ctx c = ctx("combine");
    const epcomm::CombineInput in = combine_input(c, expert_out, row_offsets, src_info, used_rows);
    const epcomm::CombineOutput o = combine_output(c, weights, out, stream);
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
    const epcomm::CombineOutput o = combine_output(c, weights, out, stream);
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
    const epcomm::Sizes& s = live()->sizes();
    const epcomm::Config& c = live()->config();
    const epcomm::TokenFormat f = c.format;
    const int64_t rows = s.max_recv_rows;
    auto make = [&](const DeviceBuffer& b, std::vector<size_t> shape, nb::dlpack::dtype dt) {
      return Array(b.ptr, shape.size(), shape.data(), owner, nullptr, dt, nb::device::cuda::value,
                   live()->device());
    };
    const auto u8 = nb::dtype<uint8_t>(), i32 = nb::dtype<int32_t>(), f32 = nb::dtype<float>();
    const nb::dlpack::dtype bf16 =
        plain ? nb::dtype<uint16_t>()
              : nb::dlpack::dtype{uint8_t(nb::dlpack::dtype_code::Bfloat), 16, 1};
    if (name == "tokens") {
      if (f == epcomm::TokenFormat::kBF16)
        return make(tokens_, {size_t(rows), size_t(c.hidden)}, bf16);
      return make(tokens_, {size_t(rows), size_t(s.token_bytes)}, u8);
    }
    if (name == "scales") {
      if (f == epcomm::TokenFormat::kBF16) return make(scales_, {0}, u8);
      if (f == epcomm::TokenFormat::kFp8Blockwise)
        return make(scales_, {size_t(c.hidden / 128), size_t(rows)}, f32);
      if (f == epcomm::TokenFormat::kMxfp4)
        return make(scales_, {size_t(rows), size_t(c.hidden / 32)}, u8);
      return make(scales_, {size_t(s.scales_bytes)}, u8);
    }
    if (name == "row_offsets") return make(row_offsets_, {size_t(s.num_groups + 1)}, i32);
    if (name == "expert_ids") return make(expert_ids_, {size_t(s.num_groups)}, i32);
    if (name == "src_info") return make(src_info_, {size_t(rows), 2}, i32);
    if (name == "scales_offsets") return make(scales_offsets_, {size_t(s.num_scales_offsets)}, i32);
    if (name == "out") return make(out_, {size_t(c.max_tokens_per_rank), size_t(c.hidden)}, bf16);
    if (name == "out_unreduced") {
      unreduced_buffer(ctx("combine"), 0);
      return make(unreduced_, {size_t(c.max_tokens_per_rank), size_t(c.top_k), size_t(c.hidden)},
                  bf16);
    }
    invalid("epcomm: no buffer named '" + name + "'");
  }

  int32_t last_tokens() const { return live()->last_dispatch().num_tokens; }
  bool last_weighted() const { return live()->last_dispatch().weights; }

 private:
  epcomm::Group* live() const {
    if (!g_) invalid("epcomm: this group was closed");
    return g_.get();
  }
  std::unique_ptr<epcomm::Group> g_;
  DeviceBuffer tokens_, scales_, row_offsets_, expert_ids_, src_info_, scales_offsets_, out_,
      unreduced_;
};

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

// ---- reference model ---------------------------------------------------------------------------

template <class T>
nb::ndarray<nb::numpy, T> to_numpy(std::vector<T> v, std::vector<size_t> shape) {
  auto* heap = new std::vector<T>(std::move(v));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T>(heap->data(), shape.size(), shape.data(), owner);
}

template <class T>
std::vector<T> from_numpy(const nb::ndarray<T, nb::device::cpu, nb::c_contig>& a) {
  return std::vector<T>(a.data(), a.data() + a.size());
}

std::vector<epcomm::SrcInfo> src_info_from(
    const nb::ndarray<int32_t, nb::device::cpu, nb::c_contig>& a) {
  if (a.ndim() != 2 || a.shape(1) != 2) invalid("src_info must be int32 [rows, 2]");
  std::vector<epcomm::SrcInfo> v(a.shape(0));
  std::memcpy(v.data(), a.data(), v.size() * sizeof(epcomm::SrcInfo));
  return v;
}

nb::ndarray<nb::numpy, int32_t> src_info_to(const std::vector<epcomm::SrcInfo>& v) {
  std::vector<int32_t> raw(v.size() * 2);
  std::memcpy(raw.data(), v.data(), v.size() * sizeof(epcomm::SrcInfo));
  return to_numpy(std::move(raw), {v.size(), 2});
}

using U16 = nb::ndarray<uint16_t, nb::device::cpu, nb::c_contig>;
using I32 = nb::ndarray<int32_t, nb::device::cpu, nb::c_contig>;
using U8 = nb::ndarray<uint8_t, nb::device::cpu, nb::c_contig>;

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

NB_MODULE(_epcomm, m) {
  m.doc() = "epcomm: expert-parallel dispatch and combine (the C++ library's bindings)";

  // Errors: epcomm.Error (a RuntimeError) with .code, an ErrorCode; kInvalidArgument is
  // raised as epcomm.InvalidArgument, which is also a ValueError.
  nb::enum_<ErrorCode>(m, "ErrorCode")
      .value("ok", ErrorCode::kOk)
      .value("invalid_argument", ErrorCode::kInvalidArgument)
      .value("config_mismatch", ErrorCode::kConfigMismatch)
      .value("setup", ErrorCode::kSetup)
      .value("cuda", ErrorCode::kCuda)
      .value("timeout", ErrorCode::kTimeout)
      .value("bad_expert_id", ErrorCode::kBadExpertId)
      .value("duplicate_expert", ErrorCode::kDuplicateExpert)
      .value("poisoned", ErrorCode::kPoisoned)
      .value("bootstrap", ErrorCode::kBootstrap)
      .value("recv_capacity", ErrorCode::kRecvCapacity)
      .value("bad_peer_data", ErrorCode::kBadPeerData);
  static PyObject* error_type =
      PyErr_NewExceptionWithDoc("epcomm.Error", "An error reported by epcomm; .code says which.",
                                PyExc_RuntimeError, nullptr);
  static PyObject* invalid_type = PyErr_NewExceptionWithDoc(
      "epcomm.InvalidArgument", "A bad argument or configuration value (also a ValueError).",
      nb::make_tuple(nb::handle(error_type), nb::handle(PyExc_ValueError)).release().ptr(),
      nullptr);
  m.attr("Error") = nb::handle(error_type);
  m.attr("InvalidArgument") = nb::handle(invalid_type);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      PyObject* type = e.code() == ErrorCode::kInvalidArgument ? invalid_type : error_type;
      nb::object exc = nb::borrow(type)(nb::str(e.what()));
      exc.attr("code") = nb::cast(e.code());
      PyErr_SetObject(type, exc.ptr());
    }
  });

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

  nb::class_<epcomm::Bootstrap>(m, "Bootstrap", "How the ranks of a group find each other.")
      .def_prop_ro("rank", &epcomm::Bootstrap::rank)
      .def_prop_ro("size", &epcomm::Bootstrap::size)
      .def(
          "all_gather",
          [](epcomm::Bootstrap& b, nb::bytes data) {
            std::vector<char> recv(data.size() * size_t(b.size()));
            {
              nb::gil_scoped_release nogil;
              b.all_gather(data.c_str(), recv.data(), data.size());
            }
            return nb::bytes(recv.data(), recv.size());
          },
          "data"_a, "Every rank's bytes, in rank order (collective).")
      .def("barrier", [](epcomm::Bootstrap& b) {
        nb::gil_scoped_release nogil;
        b.barrier();
      });
  nb::class_<CallbackBootstrap, epcomm::Bootstrap>(
      m, "CallbackBootstrap",
      "A bootstrap whose all-gather is a Python callable: all_gather(bytes) -> bytes "
      "(size * len, rank order) or a list of size bytes objects.",
      nb::type_slots(callback_bootstrap_slots))
      .def(nb::init<int, int, nb::callable>(), "rank"_a, "size"_a, "all_gather"_a);
  nb::class_<epcomm::FileBootstrap, epcomm::Bootstrap>(
      m, "FileBootstrap", "An all-gather through files in a shared directory (any launcher).")
      .def(nb::init<std::string, int, int, double>(), "dir"_a, "rank"_a, "size"_a,
           "timeout_seconds"_a = 60.0)
      .def_static(
          "from_env", [](double t) { return epcomm::FileBootstrap::from_env(t).release(); },
          "timeout_seconds"_a = 60.0, nb::rv_policy::take_ownership);

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
           "out_src_info"_a.none() = nb::none(), "out_scales_offsets"_a.none() = nb::none())
      .def("dispatch_async", &PyGroup::dispatch_async, "tokens"_a, "topk_ids"_a, "weights"_a.none(),
           "stream"_a)
      .def("dispatch_wait", &PyGroup::dispatch_wait, "stream"_a, "out_tokens"_a.none() = nb::none(),
           "out_scales"_a.none() = nb::none(), "out_row_offsets"_a.none() = nb::none(),
           "out_expert_ids"_a.none() = nb::none(), "out_src_info"_a.none() = nb::none(),
           "out_scales_offsets"_a.none() = nb::none())
      .def("combine", &PyGroup::combine, "expert_out"_a, "weights"_a.none(), "stream"_a,
           "out"_a.none() = nb::none(), "row_offsets"_a.none() = nb::none(),
           "src_info"_a.none() = nb::none(), "used_rows"_a = -1)
      .def("combine_async", &PyGroup::combine_async, "expert_out"_a, "stream"_a,
           "row_offsets"_a.none() = nb::none(), "src_info"_a.none() = nb::none(),
           "used_rows"_a = -1)
      .def("combine_wait", &PyGroup::combine_wait, "weights"_a.none(), "stream"_a,
           "out"_a.none() = nb::none())
      .def(
          "buffer",
          [](nb::handle self, const std::string& name, bool plain) {
            return nb::cast<PyGroup&>(self).buffer(name, plain, self);
          },
          "name"_a, "plain"_a = false);

  // SiLU kernels (epcomm/silu.h). Outputs are given by the caller.
  m.def(
      "pad_expert_rows",
      [](const Array& codes, const std::optional<Array>& scales, const Array& row_offsets,
         const Array& src_info, int32_t n_ranks, const Array& padded_codes,
         const std::optional<Array>& padded_scales, const Array& counts,
         const std::optional<Array>& src_token, const std::optional<Array>& layout_range,
         uintptr_t stream) {
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
        if (bool(scales) != bool(padded_scales))
          invalid(c.op + ": give both scales and padded_scales, or neither");
        if (scales) {
          check_array(c, "scales", *scales, Elem::kF32, {-1, a.rows.max_rows},
                      "[H / 128, max_rows] (the dispatch output's)");
          a.scale_cols = int32_t(scales->shape(0));
          check_array(c, "padded_scales", *padded_scales, Elem::kF32,
                      {G, a.scale_cols, a.capacity}, "[G, H / 128, capacity]");
          a.scales = static_cast<const float*>(scales->data());
          a.padded_scales = static_cast<float*>(padded_scales->data());
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
      "codes"_a, "scales"_a.none(), "row_offsets"_a, "src_info"_a, "n_ranks"_a,
      "padded_codes"_a, "padded_scales"_a.none(), "counts"_a, "src_token"_a.none(),
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

  m.def("spans_nodes_supported", &epcomm::spans_nodes_supported,
        "Whether this build has the NVSHMEM component (built with -DEPCOMM_WITH_NVSHMEM=ON), "
        "without which a group must be one node (ranks_per_node).");

  // ---- the CPU reference model (epcomm/reference.h), on numpy arrays ----
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
      .def("num_tokens", [](const epcomm::reference::Problem& p,
                            int rank) { return p.ranks.at(size_t(rank)).num_tokens; })
      .def("tokens",
           [](const epcomm::reference::Problem& p, int rank) {
             const auto& in = p.ranks.at(size_t(rank));
             return to_numpy(in.tokens, {size_t(in.num_tokens), size_t(p.hidden)});
           })
      .def("topk_ids",
           [](const epcomm::reference::Problem& p, int rank) {
             const auto& in = p.ranks.at(size_t(rank));
             return to_numpy(in.topk_ids, {size_t(in.num_tokens), size_t(p.top_k)});
           })
      .def("weights",
           [](const epcomm::reference::Problem& p, int rank) {
             const auto& in = p.ranks.at(size_t(rank));
             return to_numpy(in.weights, {size_t(in.num_tokens), size_t(p.top_k)});
           })
      .def("set_topk_ids", [](epcomm::reference::Problem& p, int rank, const I32& ids) {
        auto& in = p.ranks.at(size_t(rank));
        if (int64_t(ids.size()) != int64_t(in.num_tokens) * p.top_k) invalid("set_topk_ids: shape");
        in.topk_ids = from_numpy(ids);
      });
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

  nb::class_<epcomm::reference::DispatchResult>(r, "DispatchResult")
      .def_prop_ro(
          "row_offsets",
          [](const epcomm::reference::DispatchResult& d) {
            return to_numpy(d.row_offsets, {d.row_offsets.size()});
          },
          nb::rv_policy::move)
      .def_prop_ro(
          "expert_ids",
          [](const epcomm::reference::DispatchResult& d) {
            return to_numpy(d.expert_ids, {d.expert_ids.size()});
          },
          nb::rv_policy::move)
      .def_prop_ro(
          "src_info",
          [](const epcomm::reference::DispatchResult& d) { return src_info_to(d.src_info); },
          nb::rv_policy::move)
      .def_prop_ro(
          "tokens",
          [](const epcomm::reference::DispatchResult& d) {
            const size_t rows = d.src_info.size();
            return to_numpy(d.tokens, {rows, rows ? d.tokens.size() / rows : 0});
          },
          nb::rv_policy::move)
      .def_prop_ro("rows", &epcomm::reference::DispatchResult::rows);
  nb::class_<epcomm::reference::QuantDispatchResult>(r, "QuantDispatchResult")
      .def_prop_ro(
          "row_offsets",
          [](const epcomm::reference::QuantDispatchResult& d) {
            return to_numpy(d.row_offsets, {d.row_offsets.size()});
          },
          nb::rv_policy::move)
      .def_prop_ro(
          "src_info",
          [](const epcomm::reference::QuantDispatchResult& d) { return src_info_to(d.src_info); },
          nb::rv_policy::move)
      .def_prop_ro("rows", &epcomm::reference::QuantDispatchResult::rows)
      .def_prop_ro(
          "expert_ids",
          [](const epcomm::reference::QuantDispatchResult& d) {
            return to_numpy(d.expert_ids, {d.expert_ids.size()});
          },
          nb::rv_policy::move)
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
         float global_scale, int64_t max_routed_rows) {
        return epcomm::reference::dispatch_quantized(
            p, rank, epcomm::reference::quant_format(parse_format(format)), global_scale,
            max_routed_rows);
      },
      "problem"_a, "rank"_a, "format"_a, "global_scale"_a = 1.0f, "max_routed_rows"_a = -1);
  r.def(
      "combine",
      [](const epcomm::reference::Problem& p,
         const std::vector<epcomm::reference::DispatchResult>& layouts,
         const std::vector<U16>& expert_out, int rank, bool weighted) {
        std::vector<std::vector<uint16_t>> y;
        for (const auto& a : expert_out)
          y.push_back(from_numpy(a));
        std::vector<double> v = epcomm::reference::combine(p, layouts, y, rank, weighted);
        const size_t T = size_t(p.ranks.at(size_t(rank)).num_tokens), H = size_t(p.hidden);
        return weighted ? to_numpy(std::move(v), {T, H})
                        : to_numpy(std::move(v), {T, size_t(p.top_k), H});
      },
      "problem"_a, "layouts"_a, "expert_out"_a, "rank"_a, "weighted"_a);
  r.def(
      "combine_expert_side",
      [](const epcomm::reference::Problem& p,
         const std::vector<epcomm::reference::DispatchResult>& layouts,
         const std::vector<U16>& expert_out, int rank) {
        std::vector<std::vector<uint16_t>> y;
        for (const auto& a : expert_out)
          y.push_back(from_numpy(a));
        std::vector<float> v = epcomm::reference::combine_expert_side(p, layouts, y, rank);
        return to_numpy(std::move(v),
                        {size_t(p.ranks.at(size_t(rank)).num_tokens), size_t(p.hidden)});
      },
      "problem"_a, "layouts"_a, "expert_out"_a, "rank"_a);
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
      "ref"_a, "row_offsets"_a, "expert_ids"_a, "src_info"_a, "tokens"_a, "hidden"_a,
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
      "ref"_a, "rows"_a, "row_bytes"_a, "row_offsets"_a, "expert_ids"_a, "src_info"_a, "codes"_a,
      "scales"_a, "scales_offsets"_a,
      "'' when a quantised dispatch output equals the reference bit for bit, else the first "
      "difference (scales as raw bytes).");
  r.def(
      "compare_combine_bf16",
      [](const nb::ndarray<double, nb::device::cpu, nb::c_contig>& ref, const U16& out) {
        if (ref.size() != out.size()) return std::string("sizes differ");
        return epcomm::reference::compare_combine_bf16(
            std::vector<double>(ref.data(), ref.data() + ref.size()), out.data(),
            int64_t(out.size()));
      },
      "ref"_a, "out"_a);
  r.def(
      "compare_combine_expert_side",
      [](const nb::ndarray<float, nb::device::cpu, nb::c_contig>& ref, const U16& out) {
        if (ref.size() != out.size()) return std::string("sizes differ");
        return epcomm::reference::compare_combine_expert_side(
            std::vector<float>(ref.data(), ref.data() + ref.size()), out.data(),
            int64_t(out.size()));
      },
      "ref"_a, "out"_a);
  r.def(
      "compare_exact_bf16",
      [](const nb::ndarray<double, nb::device::cpu, nb::c_contig>& ref, const U16& out) {
        if (ref.size() != out.size()) return std::string("sizes differ");
        return epcomm::reference::compare_exact_bf16(
            std::vector<double>(ref.data(), ref.data() + ref.size()), out.data(),
            int64_t(out.size()));
      },
      "ref"_a, "out"_a);
}
