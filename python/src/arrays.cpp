#include "arrays.h"

#include <sstream>
#include <utility>

namespace epcomm_py {

[[noreturn]] void invalid(const std::string& what) {
  throw Error(ErrorCode::kInvalidArgument, what);
}
void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(ErrorCode::kCuda, std::string(what) + ": " + cudaGetErrorString(e));
}

namespace {

const char* elem_name(Elem e) {
  static const char* const kNames[] = {// in Elem's order
                                       "bfloat16 (or uint16 holding bfloat16 bits)", "float32",
                                       "int32", "int64", "a 1-byte type (uint8 / int8 / float8)"};
  return kNames[int(e)];
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
  static const std::pair<C, const char*> kBases[] = {{C::Int, "int"},         {C::UInt, "uint"},
                                                     {C::Float, "float"},     {C::Bfloat, "bfloat"},
                                                     {C::Complex, "complex"}, {C::Bool, "bool"}};
  const std::string bits = std::to_string(int(d.bits));
  for (const auto& [code, base] : kBases)
    if (d.code == uint8_t(code)) return base + bits;
  return "dtype-code-" + std::to_string(int(d.code)) + "-bits-" + bits;
}

}  // namespace

std::string shape_str(const Array& a) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < a.ndim(); ++i)
    os << (i ? ", " : "") << a.shape(i);
  os << "]";
  return os.str();
}

namespace {

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

}  // namespace

// In this order: element type, shape (a dimension of -1 matches any size), contiguity, device.
void check_array(const Ctx& c, const char* name, const Array& a, Elem elem,
                 const std::vector<int64_t>& shape, const char* shape_doc) {
  const std::string who = c.op + ": " + name;
  if (!elem_matches(a.dtype(), elem))
    invalid(who + " must be " + elem_name(elem) + "; got " + dtype_name(a.dtype()));
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

bool check_ids(const Ctx& c, const char* name, const Array& a, const std::vector<int64_t>& shape,
               const char* shape_doc) {
  const bool wide = elem_matches(a.dtype(), Elem::kI64);
  if (!wide && !elem_matches(a.dtype(), Elem::kI32))
    invalid(c.op + ": " + name + " must be int32 or int64; got " + dtype_name(a.dtype()));
  check_array(c, name, a, wide ? Elem::kI64 : Elem::kI32, shape, shape_doc);
  return wide;
}

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

}  // namespace epcomm_py
