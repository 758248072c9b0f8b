// The array checks of epcomm._epcomm's bindings (python/src): DLPack arrays checked for dtype,
// shape, device and contiguity, with a message that names the call, the rank and the argument;
// the device guard; streams as integers.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "epcomm/error.h"

namespace epcomm_py {

namespace nb = nanobind;

using Array = nb::ndarray<>;
using epcomm::Error;
using epcomm::ErrorCode;

[[noreturn]] void invalid(const std::string& what);
void cuda_check(cudaError_t e, const char* what);

// The element types the API takes. kBytes: any 1-byte type (uint8, int8, float8 variants).
enum class Elem { kBf16, kF32, kI32, kI64, kBytes };

std::string shape_str(const Array& a);

// Where a check runs: "epcomm dispatch (rank 2)" and the device the arrays must be on.
struct Ctx {
  std::string op;
  int device;
};

// In this order: element type, shape (a dimension of -1 matches any size), contiguity, device.
void check_array(const Ctx& c, const char* name, const Array& a, Elem elem,
                 const std::vector<int64_t>& shape, const char* shape_doc);

// Top-k ids, int32 or int64 (what torch.topk gives; the kernels read either as it is): the
// element type, then check_array's checks. Returns whether they are int64.
bool check_ids(const Ctx& c, const char* name, const Array& a, const std::vector<int64_t>& shape,
               const char* shape_doc);

// An output buffer given by the caller: contiguous CUDA memory on the device, at least `bytes`.
void check_out(const Ctx& c, const char* name, const Array& a, int64_t bytes);

// The caller's current device is restored when a call returns (the library selects the
// group's device to launch).
struct DeviceGuard {
  int prev = -1;
  DeviceGuard() { (void)cudaGetDevice(&prev); }
  ~DeviceGuard() {
    if (prev >= 0) (void)cudaSetDevice(prev);
  }
};

inline cudaStream_t as_stream(uintptr_t s) {
  return reinterpret_cast<cudaStream_t>(s);
}

}  // namespace epcomm_py
