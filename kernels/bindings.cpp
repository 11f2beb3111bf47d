// Python bindings of the CPU shared-memory backend: asap_comm._C
//
// Tensors never cross this boundary: Python validates them and passes
// addresses and byte counts. Setup-time calls are ordinary pybind11
// functions; the per-message hot path (put_signal, signal ops, waits, mailbox
// send/recv) is a handful of METH_FASTCALL functions, because pybind11's
// generic argument conversion costs more than the operation itself.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>

#include "asap_shm.hpp"
#include "prepared.hpp"

namespace py = pybind11;
using namespace asap;

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

PyObject* raise_wait(const WaitResult& r, double timeout) { return raise_wait_error(r, timeout, nullptr); }

// put_signal(dst, src, nbytes, sig, value, op, owner_ctrl) -> None
PyObject* fc_put_signal(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (!nargs_ok("put_signal", n, 7)) return nullptr;
  uint64_t dst = U(a[0]), src = U(a[1]), nbytes = U(a[2]), sig = U(a[3]), value = U(a[4]);
  int64_t op = I(a[5]);
  uint64_t ctrl = U(a[6]);
  if (failed()) return nullptr;
  if (nbytes) copy_bytes(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), nbytes);
  signal_update(reinterpret_cast<uint64_t*>(sig), value, static_cast<int>(op), reinterpret_cast<Ctrl*>(ctrl));
  Py_RETURN_NONE;
}

// signal_update(sig, value, op, owner_ctrl) -> previous value
PyObject* fc_signal_update(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (!nargs_ok("signal_update", n, 4)) return nullptr;
  uint64_t sig = U(a[0]), value = U(a[1]);
  int64_t op = I(a[2]);
  uint64_t ctrl = U(a[3]);
  if (failed()) return nullptr;
  uint64_t old = signal_update(reinterpret_cast<uint64_t*>(sig), value, static_cast<int>(op),
                               reinterpret_cast<Ctrl*>(ctrl));
  return PyLong_FromUnsignedLongLong(old);
}

// load(addr) -> int  (acquire)
PyObject* fc_load(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (!nargs_ok("load", n, 1)) return nullptr;
  uint64_t addr = U(a[0]);
  if (failed()) return nullptr;
  return PyLong_FromUnsignedLongLong(A(*reinterpret_cast<uint64_t*>(addr)).load(std::memory_order_acquire));
}

// wait_until(addr, cmp, value, owner_ctrl, timeout_s, group, dep) -> value seen
PyObject* fc_wait_until(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (!nargs_ok("wait_until", n, 7)) return nullptr;
  uint64_t addr = U(a[0]);
  int64_t cmp = I(a[1]);
  uint64_t value = U(a[2]), ctrl = U(a[3]);
  double timeout = PyFloat_AsDouble(a[4]);
  uint64_t group = U(a[5]);
  int64_t dep = I(a[6]);
  if (failed()) return nullptr;
  WaitResult r = wait_until(reinterpret_cast<const uint64_t*>(addr), static_cast<int>(cmp), value,
                            reinterpret_cast<Ctrl*>(ctrl), timeout, reinterpret_cast<const Group*>(group),
                            static_cast<int>(dep));
  if (r.status == kWaitOk) return PyLong_FromUnsignedLongLong(r.value);
  return raise_wait(r, timeout);
}

// copy(dst, src, nbytes) -> None
PyObject* fc_copy(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (!nargs_ok("copy", n, 3)) return nullptr;
  uint64_t dst = U(a[0]), src = U(a[1]), nbytes = U(a[2]);
  if (failed()) return nullptr;
  copy_bytes(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), nbytes);
  Py_RETURN_NONE;
}

// --- mailbox -----------------------------------------------------------------
inline SlotHeader* slot_at(uint64_t base, uint64_t stride, uint64_t i) {
  return reinterpret_cast<SlotHeader*>(base + kMailboxHeaderBytes + i * stride);
}

// mbox_send(base, num_slots, slot_bytes, owner_ctrl, src_pe, tag, dtype, shape,
//           payload, nbytes, timeout_s, group, dst_pe) -> None
PyObject* fc_mbox_send(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (!nargs_ok("mbox_send", n, 13)) return nullptr;
  uint64_t base = U(a[0]), nslots = U(a[1]), slot_bytes = U(a[2]), ctrl = U(a[3]), src_pe = U(a[4]);
  int64_t tag = I(a[5]);
  uint64_t dtype = U(a[6]);
  PyObject* shape = a[7];
  uint64_t payload = U(a[8]), nbytes = U(a[9]);
  double timeout = PyFloat_AsDouble(a[10]);
  uint64_t group = U(a[11]);
  int64_t dst_pe = I(a[12]);
  if (failed()) return nullptr;
  if (!PyTuple_Check(shape) || PyTuple_GET_SIZE(shape) > kMaxDims) {
    PyErr_SetString(PyExc_ValueError, "_C.mbox_send: shape must be a tuple of at most 8 ints");
    return nullptr;
  }
  if (nbytes > slot_bytes) {
    PyErr_SetString(PyExc_ValueError, "_C.mbox_send: message larger than a slot");
    return nullptr;
  }
  int64_t dims[kMaxDims];
  const int ndim = static_cast<int>(PyTuple_GET_SIZE(shape));
  for (int i = 0; i < ndim; ++i) {
    dims[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
    if (failed()) return nullptr;
  }
  auto* hdr = reinterpret_cast<MailboxHeader*>(base);
  const uint64_t stride = slot_stride(slot_bytes);
  Ctrl* owner = reinterpret_cast<Ctrl*>(ctrl);
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    uint64_t pos = A(hdr->tail).load(std::memory_order_relaxed);
    SlotHeader* s = slot_at(base, stride, pos % nslots);
    uint64_t seq = A(s->seq).load(std::memory_order_acquire);
    if (seq == pos) {
      if (!A(hdr->tail).compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) continue;
      s->magic = kSlotMagic;
      s->src = static_cast<uint32_t>(src_pe);
      s->tag = tag;
      s->nbytes = nbytes;
      s->dtype = static_cast<uint32_t>(dtype);
      s->ndim = static_cast<uint32_t>(ndim);
      for (int i = 0; i < ndim; ++i) s->shape[i] = dims[i];
      if (nbytes) copy_bytes(reinterpret_cast<char*>(s) + kSlotHeaderBytes, reinterpret_cast<const void*>(payload), nbytes);
      A(s->seq).store(pos + 1, std::memory_order_seq_cst);  // publish (release)
      wake_if_sleeping(owner);
      Py_RETURN_NONE;
    }
    if (seq < pos) {
      // Full: slot pos % n still holds message pos - n. Wait for its release.
      // One deadline for the whole send, however often the race is lost.
      const double spent = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      const double left = timeout - spent > 0 ? timeout - spent : 0.0;
      WaitResult r = wait_until(&s->seq, kGe, pos, owner, left, reinterpret_cast<const Group*>(group),
                                static_cast<int>(dst_pe));
      if (r.status != kWaitOk) return raise_wait(r, timeout);
    }
    // seq > pos: another producer took this position; reload tail.
  }
}

// Validates the header of a published slot; returns nullptr with an error set
// if the header is not trustworthy.
PyObject* read_slot(SlotHeader* s, uint64_t pos, uint64_t slot_bytes, uint64_t world, uint64_t num_dtypes,
                    const uint64_t* itemsizes) {
  const uint32_t magic = s->magic, src = s->src, dtype = s->dtype, ndim = s->ndim;
  const uint64_t nbytes = s->nbytes;
  const int64_t tag = s->tag;
  char err[200] = {0};
  if (magic != kSlotMagic) snprintf(err, sizeof err, "bad magic 0x%x", magic);
  else if (src >= world) snprintf(err, sizeof err, "source PE %u out of range [0, %llu)", src, (unsigned long long)world);
  else if (nbytes > slot_bytes) snprintf(err, sizeof err, "nbytes %llu > slot_bytes %llu", (unsigned long long)nbytes, (unsigned long long)slot_bytes);
  else if (dtype >= num_dtypes) snprintf(err, sizeof err, "dtype code %u unknown", dtype);
  else if (ndim > static_cast<uint32_t>(kMaxDims)) snprintf(err, sizeof err, "ndim %u > %d", ndim, kMaxDims);
  int64_t dims[kMaxDims];
  if (!err[0]) {
    unsigned __int128 numel = 1;
    for (uint32_t i = 0; i < ndim; ++i) {
      dims[i] = s->shape[i];
      if (dims[i] < 0) { snprintf(err, sizeof err, "negative dim %lld", (long long)dims[i]); break; }
      numel *= static_cast<uint64_t>(dims[i]);
      if (numel > slot_bytes) numel = static_cast<unsigned __int128>(slot_bytes) + 1;  // clamp, stays > bound
    }
    if (!err[0] && numel * itemsizes[dtype] != nbytes)
      snprintf(err, sizeof err, "shape does not match nbytes %llu", (unsigned long long)nbytes);
  }
  if (err[0]) {
    PyErr_Format(g_comm_error, "mailbox: corrupt message header at position %llu: %s",
                 static_cast<unsigned long long>(pos), err);
    return nullptr;
  }
  PyObject* shape = PyTuple_New(ndim);
  if (shape == nullptr) return nullptr;
  for (uint32_t i = 0; i < ndim; ++i) PyTuple_SET_ITEM(shape, i, PyLong_FromLongLong(dims[i]));
  return Py_BuildValue("(KIKLIN)", static_cast<unsigned long long>(pos), src, static_cast<unsigned long long>(nbytes),
                       static_cast<long long>(tag), dtype, shape);
}

uint64_t g_itemsizes[64];
uint64_t g_num_dtypes = 0;

// mbox_recv(base, num_slots, slot_bytes, world, owner_ctrl, timeout_s, group)
//   -> (pos, src, nbytes, tag, dtype, shape) or None if timeout_s < 0 and empty
// timeout_s < 0 means poll: never wait.
PyObject* fc_mbox_recv(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (!nargs_ok("mbox_recv", n, 7)) return nullptr;
  uint64_t base = U(a[0]), nslots = U(a[1]), slot_bytes = U(a[2]), world = U(a[3]), ctrl = U(a[4]);
  double timeout = PyFloat_AsDouble(a[5]);
  uint64_t group = U(a[6]);
  if (failed()) return nullptr;
  auto* hdr = reinterpret_cast<MailboxHeader*>(base);
  const uint64_t pos = hdr->head;  // consumer-private
  SlotHeader* s = slot_at(base, slot_stride(slot_bytes), pos % nslots);
  uint64_t seq = A(s->seq).load(std::memory_order_acquire);
  if (seq != pos + 1) {
    if (timeout < 0) Py_RETURN_NONE;
    WaitResult r = wait_until(&s->seq, kGe, pos + 1, reinterpret_cast<Ctrl*>(ctrl), timeout,
                              reinterpret_cast<const Group*>(group), kDepAny);
    if (r.status != kWaitOk) return raise_wait(r, timeout);
    seq = r.value;
  }
  if (seq != pos + 1) {
    PyErr_Format(g_comm_error, "mailbox: slot sequence %llu at position %llu is inconsistent",
                 static_cast<unsigned long long>(seq), static_cast<unsigned long long>(pos));
    return nullptr;
  }
  PyObject* out = read_slot(s, pos, slot_bytes, world, g_num_dtypes, g_itemsizes);
  hdr->head = pos + 1;  // consumed (even if corrupt: never re-read a bad header)
  if (out == nullptr) {
    // Free the slot so producers are not blocked behind a corrupt message.
    A(s->seq).store(pos + nslots, std::memory_order_seq_cst);
    wake_if_sleeping(reinterpret_cast<Ctrl*>(ctrl));
  }
  return out;
}

// mbox_release(base, num_slots, slot_bytes, pos, owner_ctrl) -> None
PyObject* fc_mbox_release(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (!nargs_ok("mbox_release", n, 5)) return nullptr;
  uint64_t base = U(a[0]), nslots = U(a[1]), slot_bytes = U(a[2]), pos = U(a[3]), ctrl = U(a[4]);
  if (failed()) return nullptr;
  SlotHeader* s = slot_at(base, slot_stride(slot_bytes), pos % nslots);
  A(s->seq).store(pos + nslots, std::memory_order_seq_cst);
  wake_if_sleeping(reinterpret_cast<Ctrl*>(ctrl));
  Py_RETURN_NONE;
}

PyMethodDef g_fast_methods[] = {
    {"put_signal", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(fc_put_signal)), METH_FASTCALL,
     "put_signal(dst, src, nbytes, sig, value, op, owner_ctrl)"},
    {"signal_update", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(fc_signal_update)), METH_FASTCALL,
     "signal_update(sig, value, op, owner_ctrl) -> old"},
    {"load", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(fc_load)), METH_FASTCALL, "load(addr) -> int"},
    {"wait_until", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(fc_wait_until)), METH_FASTCALL,
     "wait_until(addr, cmp, value, owner_ctrl, timeout_s, group, dep) -> int"},
    {"copy", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(fc_copy)), METH_FASTCALL, "copy(dst, src, nbytes)"},
    {"mbox_send", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(fc_mbox_send)), METH_FASTCALL,
     "mbox_send(base, num_slots, slot_bytes, owner_ctrl, src_pe, tag, dtype, shape, payload, nbytes, timeout_s, group, dst_pe)"},
    {"mbox_recv", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(fc_mbox_recv)), METH_FASTCALL,
     "mbox_recv(base, num_slots, slot_bytes, world, owner_ctrl, timeout_s, group) -> tuple | None"},
    {"mbox_release", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(fc_mbox_release)), METH_FASTCALL,
     "mbox_release(base, num_slots, slot_bytes, pos, owner_ctrl)"},
    {"make_put_signal", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(asap::make_put_signal)),
     METH_FASTCALL, "make_put_signal(dst, src, nbytes, sig, op, owner_ctrl, group, keep) -> PreparedPutSignal"},
    {"make_wait", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(asap::make_wait)), METH_FASTCALL,
     "make_wait(addr, cmp, owner_ctrl, timeout_s, group, dep, keep, what) -> PreparedWait"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

namespace asap {

PyObject* comm_error_type() { return g_comm_error; }

PyObject* raise_wait_error(const WaitResult& r, double timeout, PyObject* what) {
  if (r.status == kWaitInterrupted) return nullptr;  // KeyboardInterrupt etc. already set
  std::string prefix;
  if (what != nullptr) {
    const char* w = PyUnicode_AsUTF8(what);
    if (w != nullptr) prefix = std::string(w) + ": ";
    PyErr_Clear();
  }
  if (r.status == kWaitPeer) {
    std::string msg = prefix + "PE " + std::to_string(r.pe) + " " + r.why + " while waited on";
    PyObject* exc = PyObject_CallFunction(g_peer_failure, "sis", msg.c_str(), r.pe, r.why);
    if (exc != nullptr) {
      PyErr_SetObject(g_peer_failure, exc);
      Py_DECREF(exc);
    }
    return nullptr;
  }
  char buf[160];
  snprintf(buf, sizeof buf, "timed out after %.3g s (last value seen: %llu)", timeout,
           static_cast<unsigned long long>(r.value));
  PyErr_SetString(g_timeout_error, (prefix + buf).c_str());
  return nullptr;
}

}  // namespace asap

PYBIND11_MODULE(_C, m) {
  m.doc() = "asap_comm native core (CPU shared-memory backend)";

  py::class_<Mapping>(m, "Mapping", py::buffer_protocol())
      .def_property_readonly("addr", &Mapping::addr)
      .def_property_readonly("size", &Mapping::size)
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
      .def("set_peer", &Group::set_peer, py::arg("pe"), py::arg("ctrl_addr"), py::arg("pid"))
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
    auto* c = reinterpret_cast<Ctrl*>(addr);
    std::memset(c, 0, sizeof *c);
    c->magic = kCtrlMagic;
    c->rank = static_cast<uint32_t>(rank);
    c->pid = static_cast<uint32_t>(pid);
    A(c->state).store(kStateAlive, std::memory_order_seq_cst);
  });
  m.def("ctrl_check", [](uintptr_t addr, int rank) {
    auto* c = reinterpret_cast<Ctrl*>(addr);
    return c->magic == kCtrlMagic && c->rank == static_cast<uint32_t>(rank);
  });
  m.def("ctrl_set_state", [](uintptr_t addr, uint32_t state) {
    auto* c = reinterpret_cast<Ctrl*>(addr);
    A(c->state).store(state, std::memory_order_seq_cst);
    // Ring unconditionally: a peer sleeping on anything must re-check liveness.
    A(c->futex_seq).fetch_add(1, std::memory_order_seq_cst);
    wake_if_sleeping(c);
  });
  m.def("ctrl_pid", [](uintptr_t addr) { return reinterpret_cast<Ctrl*>(addr)->pid; });
  m.attr("CTRL_BYTES") = py::int_(4096);
  m.attr("BARRIER_ARRIVE_OFFSET") = py::int_(offsetof(Ctrl, barrier_arrive));
  m.attr("BARRIER_GEN_OFFSET") = py::int_(offsetof(Ctrl, barrier_gen));
  m.attr("STATE_CLOSED") = py::int_(static_cast<int>(kStateClosed));
  m.attr("DEP_ANY") = py::int_(kDepAny);
  m.attr("DEP_ALL") = py::int_(kDepAll);

  m.def("fence", [] { std::atomic_thread_fence(std::memory_order_seq_cst); },
        "Full fence: orders this PE's earlier puts before its later ones.");
  m.def("mailbox_init", &mailbox_init, py::arg("base"), py::arg("slot_bytes"), py::arg("num_slots"));
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
  m.def("_set_itemsizes", [](const std::vector<uint64_t>& sizes) {
    if (sizes.size() > 64) throw std::invalid_argument("too many dtypes");
    for (size_t i = 0; i < sizes.size(); ++i) g_itemsizes[i] = sizes[i];
    g_num_dtypes = sizes.size();
  });

  if (PyModule_AddFunctions(m.ptr(), g_fast_methods) != 0) throw py::error_already_set();
  if (!register_prepared_types(m.ptr())) throw py::error_already_set();
}
