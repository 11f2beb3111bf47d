// Python bindings of the network engine (pybind11): asap_comm._C.NetEngine,
// net_load and NET_AVAILABLE (false when the module was built without UCX's
// headers). The engine itself knows no binding library: its Python-facing
// types (bytes, the handshake list, the stats dict) and its errors are made
// here (docs/native.md, "One binding rule").
#include <Python.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "asap_shm.hpp"

#ifdef ASAP_HAVE_UCX

#include <exception>
#include <string>

#include "ctrl.hpp"
#include "handles.hpp"
#include "net_engine.hpp"

namespace py = pybind11;

namespace asap {
namespace {

using net::NetEngine;

CtrlSpan ctrl_word_span(const char* fn, int64_t word) {
  CtrlSpan s;
  if (!ctrl_span(word, &s)) throw py::value_error(std::string("_C.NetEngine.") + fn + ": unknown control word " + std::to_string(word));
  return s;
}

}  // namespace

void bind_net(py::module& m) {
  m.attr("NET_AVAILABLE") = true;
  // net::PythonError: a Python exception (TimeoutError, PeerFailure, KeyboardInterrupt) is set already.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const net::PythonError&) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "net: an error without an exception");
    }
  });
  m.def("net_load", &net::load_ucx, py::arg("ucp_path"), py::arg("ucs_path"),
        "Load UCX's libraries (paths of libucp.so and libucs.so) once per process.");
  py::class_<NetEngine>(m, "NetEngine")
      .def(py::init([](Group& g, uintptr_t own_ctrl, double peer_timeout_s, const std::string& tls) {
             auto* e = new NetEngine(&g, own_ctrl, peer_timeout_s, tls);
             g.set_net(e);
             return e;
           }),
           py::arg("group"), py::arg("own_ctrl"), py::arg("peer_timeout_s"), py::arg("tls"), py::keep_alive<1, 2>())
      .def("address", [](NetEngine& e) { return py::bytes(e.address()); })
      .def("connect", &NetEngine::connect, py::arg("pe"), py::arg("address"))
      .def("start", &NetEngine::start)
      .def("handshake_send", &NetEngine::handshake_send, py::arg("pe"), py::arg("answer"), py::arg("payload"))
      // [(pe, "challenge" | "answer", payload)]
      .def("take_handshakes",
           [](NetEngine& e) {
             py::list out;
             for (const auto& x : e.take_handshakes())
               out.append(py::make_tuple(x.pe, x.kind == net::kHello ? "challenge" : "answer", py::bytes(x.payload)));
             return out;
           })
      .def("authenticate", &NetEngine::authenticate, py::arg("pe"))
      .def("fence", &NetEngine::fence, py::arg("pe"))
      .def("watch", &NetEngine::watch, py::arg("pe"), py::arg("fd"))
      .def("add_region",
           [](NetEngine& e, uint32_t index, const Mapping& mp) { e.add_region(index, mp.addr(), mp.size()); },
           py::arg("index"), py::arg("mapping"), "Region `index` (1 + heap chunk) is this mapping.")
      // The user's side of a put or get is a tensor and a byte range of it (never an address).
      .def("put",
           [](NetEngine& e, int pe, uint32_t region, uint64_t off, py::handle src, uint64_t src_off, uint64_t nbytes) {
             uintptr_t p;
             if (!tensor_span(src.ptr(), "put", "src", src_off, nbytes, &p)) throw py::error_already_set();
             e.put(pe, region, off, p, nbytes);
           },
           py::arg("pe"), py::arg("region"), py::arg("off"), py::arg("src"), py::arg("src_off"), py::arg("nbytes"))
      .def("signal", &NetEngine::signal, py::arg("pe"), py::arg("region"), py::arg("off"), py::arg("value"),
           py::arg("op"), py::arg("fetch"), py::arg("timeout_s"))
      .def("get",
           [](NetEngine& e, int pe, uint32_t region, uint64_t off, py::handle dst, uint64_t dst_off, uint64_t nbytes,
              double timeout_s) {
             uintptr_t p;
             if (!tensor_span(dst.ptr(), "get", "dst", dst_off, nbytes, &p)) throw py::error_already_set();
             e.get(pe, region, off, p, nbytes, timeout_s);
           },
           py::arg("pe"), py::arg("region"), py::arg("off"), py::arg("dst"), py::arg("dst_off"), py::arg("nbytes"),
           py::arg("timeout_s"))
      // The control block by word id (kernels/ctrl.hpp): Python never adds its offsets.
      .def("signal_ctrl",
           [](NetEngine& e, int pe, int64_t word, uint64_t value, int op, bool fetch, double timeout_s) {
             return e.signal(pe, 0, ctrl_word_span("signal_ctrl", word).off, value, op, fetch, timeout_s);
           },
           py::arg("pe"), py::arg("word"), py::arg("value"), py::arg("op"), py::arg("fetch"), py::arg("timeout_s"))
      .def("get_ctrl",
           [](NetEngine& e, int pe, int64_t word, py::handle dst, double timeout_s) {
             const CtrlSpan s = ctrl_word_span("get_ctrl", word);
             uintptr_t p;
             if (!tensor_span(dst.ptr(), "get", "dst", 0, s.nbytes, &p)) throw py::error_already_set();
             e.get(pe, 0, s.off, p, s.nbytes, timeout_s);
           },
           py::arg("pe"), py::arg("word"), py::arg("dst"), py::arg("timeout_s"))
      .def("quiet", &NetEngine::quiet, py::arg("timeout_s"))
      .def("poll", &NetEngine::poll)
      .def("stats",
           [](NetEngine& e) {
             const net::NetStats s = e.stats();
             py::dict d;
             d["disorder"] = s.disorder;
             d["bad_messages"] = s.bad_messages;
             d["unauthenticated"] = s.unauthenticated;
             d["fenced"] = s.fenced;
             d["received"] = s.received;
             d["sent"] = s.sent;
             d["liveness_lines"] = s.liveness_lines;
             d["mbox_unanswered"] = s.mbox_unanswered;
             d["mbox_resumed"] = s.mbox_resumed;
             d["mbox_abandoned"] = s.mbox_abandoned;
             d["progress_wakeups"] = s.progress_wakeups;
             d["progress_parks"] = s.progress_parks;
             d["last_error"] = s.last_error;
             return d;
           })
      .def("shutdown", &NetEngine::shutdown, py::call_guard<py::gil_scoped_release>());
}

}  // namespace asap

#else  // !ASAP_HAVE_UCX

namespace py = pybind11;
namespace asap {
void bind_net(py::module& m) { m.attr("NET_AVAILABLE") = false; }
}  // namespace asap

#endif
