// hipferry._C.InFlightWindow: the copy scheduler's bound on bytes in flight
// (csrc/core/schedule/in_flight_window.h) over Transfer handles, for the
// Python queues that offload as autograd produces tensors (offload_layers'
// gradient sink, offload_activations). Python keeps the policy (what to offload, what a settled
// copy becomes); the window decides when the host must wait.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>

#include <memory>

#include "csrc/core/errors.h"
#include "csrc/core/schedule/in_flight_window.h"
#include "csrc/torch/python_errors.h"
#include "csrc/torch/transfer_engine.h"

namespace py = pybind11;

namespace hipferry {
namespace {

// A Transfer's completion as a scheduler event. Called with the GIL held
// (from the window's Python methods); blocking waits release it.
class TransferEvent : public schedule::Event {
 public:
  explicit TransferEvent(std::shared_ptr<Transfer> t) : transfer_(std::move(t)) {}
  bool query() override { return transfer_->ready(); }
  void synchronize() override {
    py::gil_scoped_release no_gil;
    transfer_->synchronize();
  }

 private:
  std::shared_ptr<Transfer> transfer_;
};

}  // namespace

void bind_in_flight_window(py::module_& m) {
  py::class_<schedule::InFlightWindow>(m, "InFlightWindow",
                                       "A bound on the bytes that transfers in flight may hold (settled oldest first).")
      .def(py::init([](std::size_t max_bytes) {
             return translate_errors([&] {
               HF_CHECK_VALUE(max_bytes > 0, "InFlightWindow: max_bytes must be > 0, got 0");
               return std::make_unique<schedule::InFlightWindow>(max_bytes);
             });
           }),
           py::arg("max_bytes"))
      .def(
          "admit", [](schedule::InFlightWindow& w, std::size_t bytes) { translate_errors([&] { w.admit(bytes); }); },
          py::arg("bytes"), "Settles what completed, then waits for the oldest until `bytes` more fit.")
      .def(
          "add",
          [](schedule::InFlightWindow& w, std::shared_ptr<Transfer> t, std::size_t bytes, py::object settled) {
            std::function<void()> callback;
            if (!settled.is_none()) {
              // Runs on the settling thread, which holds the GIL (admit / settle / drain are called from Python).
              auto fn = std::make_shared<py::object>(std::move(settled));
              callback = [fn] { (*fn)(); };
            }
            return w.add(std::make_shared<TransferEvent>(std::move(t)), bytes, std::move(callback));
          },
          py::arg("transfer"), py::arg("bytes"), py::arg("settled") = py::none(),
          "Counts a transfer in flight; returns its entry id. `settled()` runs when the window settles it.")
      .def("withdraw", &schedule::InFlightWindow::withdraw, py::arg("id"),
           "Takes entry `id` back unsettled (its callback never runs); False if it is no longer in the window.")
      .def("settle", [](schedule::InFlightWindow& w) { return translate_errors([&] { return w.settle(); }); })
      .def("drain", [](schedule::InFlightWindow& w) { translate_errors([&] { w.drain(); }); })
      .def_property_readonly("bytes", &schedule::InFlightWindow::bytes)
      .def_property_readonly("peak_bytes", &schedule::InFlightWindow::peak_bytes)
      .def_property_readonly("entries", &schedule::InFlightWindow::entries)
      .def_property_readonly("waits", &schedule::InFlightWindow::waits);
}

}  // namespace hipferry
