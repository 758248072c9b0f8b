// Bootstraps: the C++ kinds, and one whose all-gather is a Python callable.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstring>
#include <string>
#include <vector>

#include "arrays.h"
#include "bindings.h"
#include "epcomm/bootstrap.h"

namespace epcomm_py {

using namespace nb::literals;

namespace {

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

}  // namespace

void bind_bootstrap(nb::module_& m) {
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
      .def(nb::init<std::string, int, int, double, std::string>(), "dir"_a, "rank"_a, "size"_a,
           "timeout_seconds"_a = 60.0, "job"_a = "",
           "job names the launch (the same on every rank): jobs with different names never "
           "see each other's files in one directory.")
      .def_prop_ro("job", &epcomm::FileBootstrap::job)
      .def_static(
          "from_env", [](double t) { return epcomm::FileBootstrap::from_env(t).release(); },
          "timeout_seconds"_a = 60.0, nb::rv_policy::take_ownership);
}

}  // namespace epcomm_py
