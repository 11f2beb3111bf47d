// The per-message entry points of the shared-memory backend, and the error
// helpers every binding shares: plain CPython functions (METH_FASTCALL), see
// docs/native.md ("One binding rule").
//
// The native boundary's rules (see kernels/handles.hpp):
// * An address in symmetric memory may come from Python as an int; every
//   entry point checks it against the live segment mappings before use.
// * An address in the user's memory never does: entry points take the
//   tensor and read its address and extent from it (tensor_span).
// * put_signal and the signal wait have one native form each, the handles of
//   handles_py.cpp.
#include <Python.h>

#include <atomic>
#include <cstring>
#include <string>

#include "asap_shm.hpp"
#include "ctrl.hpp"
#include "handles.hpp"

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

// fence(): a full fence; orders this PE's earlier puts before its later ones.
PyObject* fc_fence(PyObject*, PyObject*) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  Py_RETURN_NONE;
}

// _set_error_types(comm_error, timeout_error, peer_failure): the exception types of asap_comm/errors.py.
PyObject* fc_set_error_types(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (!nargs_ok("_set_error_types", n, 3)) return nullptr;
  for (Py_ssize_t i = 0; i < 3; ++i) Py_INCREF(a[i]);
  g_comm_error = a[0];
  g_timeout_error = a[1];
  g_peer_failure = a[2];
  Py_RETURN_NONE;
}

PyMethodDef g_fast_methods[] = {
    {"fence", fc_fence, METH_NOARGS, "Full fence: orders this PE's earlier puts before its later ones."},
    {"_set_error_types", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(fc_set_error_types)),
     METH_FASTCALL, "_set_error_types(comm_error, timeout_error, peer_failure)"},
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

bool register_ops(PyObject* module) { return PyModule_AddFunctions(module, g_fast_methods) == 0; }

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
