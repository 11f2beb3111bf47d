// Python bindings of the CPU shared-memory backend: asap_comm._C
//
// The native boundary's rules (see kernels/handles.hpp):
// * An address in symmetric memory may come from Python as an int; every
//   entry point checks it against the live segment mappings before use.
// * An address in the user's memory never does: entry points take the
//   tensor and read its address and extent from it (tensor_span).
// * put_signal and the signal wait have one native form each, the handles of
//   handles.cpp; the per-message entry points are METH_FASTCALL / vectorcall
//   functions, because pybind11's generic argument conversion costs more
//   than the operation itself. Set-up calls are ordinary pybind11 functions.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>

#include "asap_shm.hpp"
#include "ctrl.hpp"
#include "handles.hpp"

namespace py = pybind11;
using namespace asap;

namespace asap {
void bind_net(py::module& m);  // kernels/net_py.cpp
}

namespace {

// Exception types registered from Python (asap_comm/errors.py).
PyObject* g_timeout_error = nullptr;
PyObject* g_peer_failure = nullptr;
PyObject* g_comm_error = nullptr;

template <typename T>
inline std::atomic_ref<T> A(T& x) {
  return std::atomic_ref<T>(x);
}

// --- fastcall argument helpers ---------------------------------------------
bool nargs_ok(const char* fn, Py_ssize_t got, Py_ssize_t want) {
  if (got == want) return true;
  PyErr_Format(PyExc_TypeError, "_C.%s: expected %zd arguments, got %zd", fn, want, got);
  return false;
}
inline uint64_t U(PyObject* o) { return PyLong_AsUnsignedLongLong(o); }
inline int64_t I(PyObject* o) { return PyLong_AsLongLong(o); }
inline bool failed() { return PyErr_Occurred() != nullptr; }

// For the pybind11 set-up calls: the same check as check_mapped, as a C++ exception.
void need_mapped(const char* fn, uintptr_t addr, size_t n) {
  if (!mapped_range(addr, n))
    throw py::value_error(std::string(fn) + ": address range is not inside a mapped asap_comm segment");
}

// signal_update(sig, value, op, owner_ctrl) -> previous value
PyObject* fc_signal_update(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (!nargs_ok("signal_update", n, 4)) return nullptr;
  uint64_t sig = U(a[0]), value = U(a[1]);
  int64_t op = I(a[2]);
  uint64_t ctrl = U(a[3]);
  if (failed()) return nullptr;
  if (!check_mapped("signal_update", "signal word", sig, 8) ||
      !check_mapped("signal_update", "control block", ctrl, sizeof(Ctrl)))
    return nullptr;
  uint64_t old = signal_update(reinterpret_cast<uint64_t*>(sig), value, static_cast<int>(op),
                               reinterpret_cast<Ctrl*>(ctrl));
  return PyLong_FromUnsignedLongLong(old);
}

// load(addr) -> int  (acquire)
PyObject* fc_load(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (!nargs_ok("load", n, 1)) return nullptr;
  uint64_t addr = U(a[0]);
  if (failed() || !check_mapped("load", "signal word", addr, 8)) return nullptr;
  return PyLong_FromUnsignedLongLong(A(*reinterpret_cast<uint64_t*>(addr)).load(std::memory_order_acquire));
}

// store(addr, value) -> None  (release)
PyObject* fc_store(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (!nargs_ok("store", n, 2)) return nullptr;
  uint64_t addr = U(a[0]), value = U(a[1]);
  if (failed() || !check_mapped("store", "signal word", addr, 8)) return nullptr;
  A(*reinterpret_cast<uint64_t*>(addr)).store(value, std::memory_order_release);
  Py_RETURN_NONE;
}

// copy_to(dst_addr, src, nbytes): a put; dst_addr lies in symmetric memory (checked against the mappings), src
// is the user's tensor (its address read from it; nbytes must lie inside it).
// copy_from(dst, src_addr, nbytes): a get, the other way round.
PyObject* fc_copy_to(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (!nargs_ok("copy_to", n, 3)) return nullptr;
  uint64_t dst = U(a[0]), nbytes = U(a[2]);
  uintptr_t src;
  if (failed() || !check_mapped("put", "destination", dst, nbytes) || !tensor_span(a[1], "put", "src", 0, nbytes, &src))
    return nullptr;
  copy_bytes(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), nbytes);
  Py_RETURN_NONE;
}
PyObject* fc_copy_from(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (!nargs_ok("copy_from", n, 3)) return nullptr;
  uint64_t src = U(a[1]), nbytes = U(a[2]);
  uintptr_t dst;
  if (failed() || !check_mapped("get", "source", src, nbytes) || !tensor_span(a[0], "get", "dst", 0, nbytes, &dst))
    return nullptr;
  copy_bytes(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), nbytes);
  Py_RETURN_NONE;
}

// The span of control word `word`, or a ValueError naming `fn` and the value.
bool ctrl_word(const char* fn, PyObject* w, CtrlSpan* span) {
  const int64_t word = I(w);
  if (failed()) return false;
  if (!ctrl_span(word, span)) {
    PyErr_Format(PyExc_ValueError, "_C.%s: unknown control word %lld", fn, static_cast<long long>(word));
    return false;
  }
  return true;
}

// ctrl_addr(ctrl_base, word) -> int: the address of `word` in the control block mapped at ctrl_base.
PyObject* fc_ctrl_addr(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (!nargs_ok("ctrl_addr", n, 2)) return nullptr;
  const uint64_t base = U(a[0]);
  CtrlSpan s;
  if (failed() || !ctrl_word("ctrl_addr", a[1], &s) || !check_mapped("ctrl_addr", "control block", base, kCtrlBytes))
    return nullptr;
  return PyLong_FromUnsignedLongLong(base + s.off);
}

// ctrl_span(word) -> (offset within the control block, nbytes)
PyObject* fc_ctrl_span(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (!nargs_ok("ctrl_span", n, 1)) return nullptr;
  CtrlSpan s;
  if (!ctrl_word("ctrl_span", a[0], &s)) return nullptr;
  return Py_BuildValue("(KK)", static_cast<unsigned long long>(s.off), static_cast<unsigned long long>(s.nbytes));
}

PyMethodDef g_fast_methods[] = {
    {"ctrl_addr", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(fc_ctrl_addr)), METH_FASTCALL,
     "ctrl_addr(ctrl_base, word) -> int: the address of a control word (_C.CTRL_*)"},
    {"ctrl_span", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(fc_ctrl_span)), METH_FASTCALL,
     "ctrl_span(word) -> (offset, nbytes) of a control word (_C.CTRL_*) within the control block"},
    {"signal_update", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(fc_signal_update)), METH_FASTCALL,
     "signal_update(sig, value, op, owner_ctrl) -> old"},
    {"load", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(fc_load)), METH_FASTCALL, "load(addr) -> int"},
    {"store", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(fc_store)), METH_FASTCALL,
     "store(addr, value): atomic release store of a uint64"},
    {"copy_to", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(fc_copy_to)), METH_FASTCALL,
     "copy_to(dst_addr, src_tensor, nbytes): a put into symmetric memory"},
    {"copy_from", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(fc_copy_from)), METH_FASTCALL,
     "copy_from(dst_tensor, src_addr, nbytes): a get from symmetric memory"},
    {"make_put_signal", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(asap::make_put_signal)),
     METH_FASTCALL, "make_put_signal(fn, group, pe, src, nbytes, op, dst, sig, owner, keep) -> PreparedPutSignal"},
    {"make_wait", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(asap::make_wait)), METH_FASTCALL,
     "make_wait(fn, group, addr, cmp, owner, timeout, dep, mask, what, keep) -> PreparedWait"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

namespace asap {

PyObject* comm_error_type() { return g_comm_error; }

PyObject* raise_wait_error(const WaitResult& r, double timeout, PyObject* what, bool show_value) {
  if (r.status == kWaitInterrupted) return nullptr;  // KeyboardInterrupt etc. already set
  std::string prefix;
  if (what != nullptr) {
    const char* w = PyUnicode_AsUTF8(what);
    if (w != nullptr) prefix = std::string(w) + ": ";
    PyErr_Clear();
  }
  if (r.status == kWaitPeer || r.status == kWaitAbandoned) {
    std::string msg = prefix + "PE " + std::to_string(r.pe) + " " + r.why +
                      (r.status == kWaitPeer ? " while waited on" : "");
    const bool died = std::strncmp(r.why, "closed", 6) != 0;
    PyObject* exc = PyObject_CallFunction(g_peer_failure, "sis", msg.c_str(), r.pe, died ? "died" : "closed");
    if (exc != nullptr) {
      PyErr_SetObject(g_peer_failure, exc);
      Py_DECREF(exc);
    }
    return nullptr;
  }
  char buf[160];
  if (show_value)
    snprintf(buf, sizeof buf, "timed out after %.3g s (last value seen: %llu)", timeout,
             static_cast<unsigned long long>(r.value));
  else
    snprintf(buf, sizeof buf, "timed out after %.3g s", timeout);
  PyErr_SetString(g_timeout_error, (prefix + buf).c_str());
  return nullptr;
}

}  // namespace asap

PYBIND11_MODULE(_C, m) {
  m.doc() = "asap_comm native core (CPU shared-memory backend)";

  py::class_<Mapping>(m, "Mapping", py::buffer_protocol())
      .def_property_readonly("addr", &Mapping::addr)
      .def_property_readonly("size", &Mapping::size)
      .def("reserve", &Mapping::reserve, py::arg("offset"), py::arg("nbytes"),
           "Allocate bytes [offset, offset + nbytes) of this PE's own segment for real; 0 or an errno.")
      .def_buffer([](Mapping& mp) -> py::buffer_info {
        return py::buffer_info(mp.ptr(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(mp.size())}, {1});
      });

  m.def("create_segment", &create_segment, py::arg("name"), py::arg("size"), py::return_value_policy::take_ownership,
        "Create, size (0600, O_EXCL) and map a shared-memory segment.");
  m.def("map_segment", &map_segment, py::arg("name"), py::arg("size"), py::return_value_policy::take_ownership,
        "Map a peer's segment; its size must match.");
  m.def("unlink_segment", &unlink_segment, py::arg("name"));

  py::class_<Group>(m, "Group")
      .def(py::init<int, int>(), py::arg("rank"), py::arg("world_size"))
      .def("set_peer",
           [](Group& g, int pe, uintptr_t ctrl_addr, int pid) {
             if (pe < 0 || pe >= g.world_size()) throw py::value_error("Group.set_peer: pe out of range");
             need_mapped("Group.set_peer", ctrl_addr, sizeof(Ctrl));
             g.set_peer(pe, ctrl_addr, pid);
           },
           py::arg("pe"), py::arg("ctrl_addr"), py::arg("pid"))
      .def("is_dead", &Group::is_dead, py::arg("pe"))
      .def("mark_closed", &Group::mark_closed)
      .def("check",
           [](const Group& g, int dep) -> py::object {
             const char* why = nullptr;
             int pe = g.check(dep, &why);
             if (pe < 0) return py::none();
             return py::make_tuple(pe, std::string(why));
           },
           py::arg("dep"))
      .def_property_readonly("handle", [](const Group& g) { return reinterpret_cast<uintptr_t>(&g); });

  m.def("ctrl_init", [](uintptr_t addr, int rank, int pid) {
    need_mapped("ctrl_init", addr, sizeof(Ctrl));
    auto* c = reinterpret_cast<Ctrl*>(addr);
    std::memset(c, 0, sizeof *c);
    c->magic = kCtrlMagic;
    c->rank = static_cast<uint32_t>(rank);
    c->pid = static_cast<uint32_t>(pid);
    A(c->state).store(kStateAlive, std::memory_order_seq_cst);
  });
  m.def("ctrl_check", [](uintptr_t addr, int rank) {
    need_mapped("ctrl_check", addr, sizeof(Ctrl));
    auto* c = reinterpret_cast<Ctrl*>(addr);
    return c->magic == kCtrlMagic && c->rank == static_cast<uint32_t>(rank);
  });
  m.def("ctrl_set_state", [](uintptr_t addr, uint32_t state) {
    need_mapped("ctrl_set_state", addr, sizeof(Ctrl));
    auto* c = reinterpret_cast<Ctrl*>(addr);
    A(c->state).store(state, std::memory_order_seq_cst);
    // Ring unconditionally: a peer sleeping on anything must re-check liveness.
    A(c->futex_seq).fetch_add(1, std::memory_order_seq_cst);
    wake_if_sleeping(c);
  });
  m.def("ctrl_pid", [](uintptr_t addr) {
    need_mapped("ctrl_pid", addr, sizeof(Ctrl));
    return reinterpret_cast<Ctrl*>(addr)->pid;
  });
  m.attr("CTRL_BYTES") = py::int_(kCtrlBytes);
  // Control words by id (kernels/ctrl.hpp): Python asks ctrl_addr / ctrl_span for them.
  m.attr("CTRL_ARRIVE") = py::int_(static_cast<int>(kCtrlArrive));
  m.attr("CTRL_GEN") = py::int_(static_cast<int>(kCtrlGen));
  m.attr("CTRL_DONE") = py::int_(static_cast<int>(kCtrlDone));
  m.attr("CTRL_RECORDS") = py::int_(static_cast<int>(kCtrlRecords));
  m.attr("CTRL_COLL_SLOT_BYTES") = py::int_(kCtrlCollSlotBytes);
  // The offsets themselves (older callers; ctrl_addr / ctrl_span replace them).
  m.attr("CTRL_COLL_OFFSET") = py::int_(kCtrlCollOffset);
  m.attr("BARRIER_ARRIVE_OFFSET") = py::int_(offsetof(Ctrl, barrier_arrive));
  m.attr("BARRIER_GEN_OFFSET") = py::int_(offsetof(Ctrl, barrier_gen));
  m.attr("BARRIER_DONE_OFFSET") = py::int_(offsetof(Ctrl, barrier_done));
  m.attr("STATE_CLOSED") = py::int_(static_cast<int>(kStateClosed));
  m.attr("DEP_ANY") = py::int_(kDepAny);
  m.attr("DEP_ALL") = py::int_(kDepAll);
  m.attr("DEP_SET") = py::int_(kDepSet);
  m.attr("DEP_OTHERS") = py::int_(kDepOthers);
  m.attr("DEP_BARRIER") = py::int_(kDepBarrier);
  m.attr("MAILBOX_MAX_PES") = py::int_(kMailboxMaxPes);

  m.def("fence", [] { std::atomic_thread_fence(std::memory_order_seq_cst); },
        "Full fence: orders this PE's earlier puts before its later ones.");
  m.def("mailbox_init",
        [](uintptr_t base, size_t slot_bytes, size_t num_slots) {
          need_mapped("mailbox_init", base, mailbox_bytes(slot_bytes, num_slots));
          mailbox_init(base, slot_bytes, num_slots);
        },
        py::arg("base"), py::arg("slot_bytes"), py::arg("num_slots"));
  m.def("mailbox_bytes", &mailbox_bytes, py::arg("slot_bytes"), py::arg("num_slots"));
  m.attr("MAILBOX_HEADER_BYTES") = py::int_(kMailboxHeaderBytes);
  m.attr("SLOT_HEADER_BYTES") = py::int_(kSlotHeaderBytes);
  m.def("slot_stride", &slot_stride, py::arg("slot_bytes"));
  m.attr("MAX_DIMS") = py::int_(kMaxDims);
  m.def("spin_budget_ns", &spin_budget_ns);

  m.def("_set_error_types", [](py::object comm_error, py::object timeout_error, py::object peer_failure) {
    g_comm_error = comm_error.release().ptr();
    g_timeout_error = timeout_error.release().ptr();
    g_peer_failure = peer_failure.release().ptr();
  });
  bind_net(m);
  if (PyModule_AddFunctions(m.ptr(), g_fast_methods) != 0) throw py::error_already_set();
  if (!register_handle_types(m.ptr())) throw py::error_already_set();
  if (!register_inbox_types(m.ptr())) throw py::error_already_set();
}
