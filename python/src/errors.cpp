// Errors: epcomm.Error and epcomm.InvalidArgument.
#include <nanobind/nanobind.h>

#include <exception>

#include "arrays.h"
#include "bindings.h"
#include "epcomm/error.h"

namespace epcomm_py {

using namespace nb::literals;

void bind_errors(nb::module_& m) {
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
}

}  // namespace epcomm_py
