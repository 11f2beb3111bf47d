// _C.FastPath: the per-call path of the generic Communicator.put_signal and
// Communicator.signal_wait_until.
//
// The Python layer validates a call once (the "slow" path) and, when the same
// (dst, src, pe, sig, idx, op) or (sig, idx, cmp) comes back, registers the
// checked addresses here. Later calls are matched by object identity in a
// small direct-mapped table (the entries hold references, so identities stay
// unique), the source's data_ptr() is re-read to catch a reallocated tensor,
// and the operation runs without Python bytecode. Anything not matched goes
// to the Python slow path with the caller's exact arguments, so argument
// errors are always raised by one piece of code.
#include <Python.h>

#include <cmath>

#include <cstring>
#include <string>

#include "asap_shm.hpp"
#include "prepared.hpp"

namespace asap {

namespace {

constexpr size_t kSlots = 64;  // power of two

struct PsEntry {
  PyObject* dst = nullptr;  // owned references: identity keys
  PyObject* src = nullptr;
  PyObject* sig = nullptr;
  long pe = 0;
  long long idx = 0;
  int op = 0;
  uint64_t dst_addr = 0, src_ptr = 0, nbytes = 0, sig_addr = 0;
  Ctrl* owner = nullptr;
};

struct WaitEntry {
  PyObject* sig = nullptr;
  long long idx = 0;
  int cmp = 0;
  uint64_t addr = 0;
};

struct FastPath {
  PyObject_HEAD
  PyObject* slow_put_signal;  // comm._put_signal_slow
  PyObject* slow_wait;        // comm._signal_wait_slow
  PyObject* keep;             // the Group object
  const Group* group;
  Ctrl* local;
  double timeout;
  PsEntry* ps;      // kSlots
  WaitEntry* wait;  // kSlots
};

PyObject* s_data_ptr = nullptr;
PyObject *s_set, *s_add, *s_cmp[6];
const char* kCmpText[6] = {"==", "!=", ">", ">=", "<", "<="};

inline size_t mix(uintptr_t a, uintptr_t b, uintptr_t c, uint64_t d) {
  uint64_t h = a * 0x9E3779B97F4A7C15ull ^ (b >> 4) * 0xC2B2AE3D27D4EB4Full ^ (c >> 4) * 0x165667B19E3779F9ull ^
               d * 0x27D4EB2F165667C5ull;
  return static_cast<size_t>((h ^ (h >> 29)) & (kSlots - 1));
}

void clear_ps(PsEntry& e) {
  Py_CLEAR(e.dst);
  Py_CLEAR(e.src);
  Py_CLEAR(e.sig);
}

int op_code(PyObject* o) {  // -1: not "set"/"add"
  if (o == s_set) return 0;
  if (o == s_add) return 1;
  if (!PyUnicode_Check(o)) return -1;
  if (PyUnicode_CompareWithASCIIString(o, "set") == 0) return 0;
  if (PyUnicode_CompareWithASCIIString(o, "add") == 0) return 1;
  return -1;
}

int cmp_code(PyObject* o) {
  for (int i = 0; i < 6; ++i)
    if (o == s_cmp[i]) return i;
  if (!PyUnicode_Check(o)) return -1;
  for (int i = 0; i < 6; ++i)
    if (PyUnicode_CompareWithASCIIString(o, kCmpText[i]) == 0) return i;
  return -1;
}

bool small_int(PyObject* o, long long* out) {
  if (!PyLong_CheckExact(o)) return false;
  int overflow = 0;
  *out = PyLong_AsLongLongAndOverflow(o, &overflow);
  return !overflow && *out >= 0;
}

bool u64_value(PyObject* o, uint64_t* out) {
  if (!PyLong_CheckExact(o)) return false;
  *out = PyLong_AsUnsignedLongLong(o);
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return true;
}

// Lays a vectorcall's positional and keyword arguments out by parameter (``names``, ``n`` of them) into
// ``out``; an absent parameter is nullptr. False (the call goes to the validating slow path, which raises the
// proper TypeError) on too many arguments, an unknown keyword or a parameter given twice.
bool arrange(PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames, const char* const* names, int n,
             PyObject** out) {
  if (nargs > n) return false;
  for (int i = 0; i < n; ++i) out[i] = i < nargs ? args[i] : nullptr;
  if (kwnames == nullptr) return true;
  const Py_ssize_t nk = PyTuple_GET_SIZE(kwnames);
  for (Py_ssize_t k = 0; k < nk; ++k) {
    PyObject* key = PyTuple_GET_ITEM(kwnames, k);
    int j = static_cast<int>(nargs);
    while (j < n && PyUnicode_CompareWithASCIIString(key, names[j]) != 0) ++j;
    if (j == n || out[j] != nullptr) return false;
    out[j] = args[nargs + k];
  }
  return true;
}

const char* const kPutSignalParams[] = {"dst", "src", "pe", "sig", "idx", "value", "op"};
const char* const kWaitParams[] = {"sig", "idx", "cmp", "value", "timeout"};

// put_signal(dst, src, pe, sig, idx, value, op="set"): any mix of positional and keyword arguments
PyObject* fp_put_signal(PyObject* self_, PyObject* const* in, Py_ssize_t nargs, PyObject* kwnames) {
  auto* self = reinterpret_cast<FastPath*>(self_);
  auto slow = [&] { return PyObject_Vectorcall(self->slow_put_signal, in, static_cast<size_t>(nargs), kwnames); };
  PyObject* args[7];
  if (!arrange(in, nargs, kwnames, kPutSignalParams, 7, args) || self->group->closed()) return slow();
  for (int i = 0; i < 6; ++i)
    if (args[i] == nullptr) return slow();
  long long pe, idx;
  uint64_t value;
  const int op = args[6] != nullptr ? op_code(args[6]) : 0;
  if (op < 0 || !small_int(args[2], &pe) || !small_int(args[4], &idx) || !u64_value(args[5], &value)) return slow();
  PsEntry& e = self->ps[mix(reinterpret_cast<uintptr_t>(args[0]), reinterpret_cast<uintptr_t>(args[1]),
                            reinterpret_cast<uintptr_t>(args[3]), static_cast<uint64_t>(pe * 1315423911ll + idx * 2 + op))];
  if (e.dst != args[0] || e.src != args[1] || e.sig != args[3] || e.pe != pe || e.idx != idx || e.op != op)
    return slow();
  PyObject* p = PyObject_CallMethodNoArgs(args[1], s_data_ptr);
  if (p == nullptr) return nullptr;
  const uint64_t src_ptr = PyLong_AsUnsignedLongLong(p);
  Py_DECREF(p);
  if (PyErr_Occurred()) return nullptr;
  if (src_ptr != e.src_ptr) {  // the source was reallocated: re-validate
    clear_ps(e);
    return slow();
  }
  if (e.nbytes) copy_bytes(reinterpret_cast<void*>(e.dst_addr), reinterpret_cast<const void*>(src_ptr), e.nbytes);
  signal_update(reinterpret_cast<uint64_t*>(e.sig_addr), value, op, e.owner);
  Py_RETURN_NONE;
}

// A timeout argument the fast path takes as is (None: the communicator's; an exact int or float that is finite
// and >= 0); anything else goes to the slow path, which raises the error.
bool fast_timeout(PyObject* t, double fallback, double* out) {
  if (t == nullptr || t == Py_None) {
    *out = fallback;
    return true;
  }
  double v;
  if (PyFloat_CheckExact(t)) {
    v = PyFloat_AS_DOUBLE(t);
  } else if (PyLong_CheckExact(t)) {
    v = PyLong_AsDouble(t);
    if (v == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
  } else {
    return false;
  }
  if (!(v >= 0.0) || std::isinf(v)) return false;
  *out = v;
  return true;
}

// signal_wait_until(sig, idx, cmp, value, timeout=None): any mix of positional and keyword arguments (peers=
// goes to the slow path)
PyObject* fp_wait(PyObject* self_, PyObject* const* in, Py_ssize_t nargs, PyObject* kwnames) {
  auto* self = reinterpret_cast<FastPath*>(self_);
  auto slow = [&] { return PyObject_Vectorcall(self->slow_wait, in, static_cast<size_t>(nargs), kwnames); };
  PyObject* args[5];
  double timeout;
  if (!arrange(in, nargs, kwnames, kWaitParams, 5, args) || args[0] == nullptr || args[1] == nullptr ||
      args[2] == nullptr || args[3] == nullptr || !fast_timeout(args[4], self->timeout, &timeout) ||
      self->group->closed())
    return slow();
  long long idx;
  uint64_t value;
  const int cmp = cmp_code(args[2]);
  if (cmp < 0 || !small_int(args[1], &idx) || !u64_value(args[3], &value)) return slow();
  WaitEntry& e = self->wait[mix(reinterpret_cast<uintptr_t>(args[0]), 0, 0, static_cast<uint64_t>(idx * 8 + cmp))];
  if (e.sig != args[0] || e.idx != idx || e.cmp != cmp) return slow();
  WaitResult r = wait_until(reinterpret_cast<const uint64_t*>(e.addr), cmp, value, self->local, timeout,
                            self->group, kDepAny);
  if (r.status == kWaitOk) return PyLong_FromUnsignedLongLong(r.value);
  PyObject* what = PyUnicode_FromFormat("signal_wait_until: waiting for sig[%lld] %s %llu", idx, kCmpText[cmp],
                                        static_cast<unsigned long long>(value));
  raise_wait_error(r, timeout, what);
  Py_XDECREF(what);
  return nullptr;
}

// add_put_signal(dst, src, pe, sig, idx, op, dst_addr, src_ptr, nbytes, sig_addr, owner)
PyObject* fp_add_put_signal(PyObject* self_, PyObject* const* a, Py_ssize_t n) {
  auto* self = reinterpret_cast<FastPath*>(self_);
  if (n != 11) {
    PyErr_SetString(PyExc_TypeError, "FastPath.add_put_signal: expected 11 arguments");
    return nullptr;
  }
  const long pe = PyLong_AsLong(a[2]);
  const long long idx = PyLong_AsLongLong(a[4]);
  const int op = static_cast<int>(PyLong_AsLong(a[5]));
  PsEntry fresh;
  fresh.pe = pe;
  fresh.idx = idx;
  fresh.op = op;
  fresh.dst_addr = PyLong_AsUnsignedLongLong(a[6]);
  fresh.src_ptr = PyLong_AsUnsignedLongLong(a[7]);
  fresh.nbytes = PyLong_AsUnsignedLongLong(a[8]);
  fresh.sig_addr = PyLong_AsUnsignedLongLong(a[9]);
  fresh.owner = reinterpret_cast<Ctrl*>(PyLong_AsUnsignedLongLong(a[10]));
  if (PyErr_Occurred()) return nullptr;
  if ((fresh.nbytes && !check_mapped("put_signal", "destination", fresh.dst_addr, fresh.nbytes)) ||
      !check_mapped("put_signal", "signal word", fresh.sig_addr, 8) ||
      !check_mapped("put_signal", "control block", reinterpret_cast<uintptr_t>(fresh.owner), sizeof(Ctrl)))
    return nullptr;
  PsEntry& e = self->ps[mix(reinterpret_cast<uintptr_t>(a[0]), reinterpret_cast<uintptr_t>(a[1]),
                            reinterpret_cast<uintptr_t>(a[3]), static_cast<uint64_t>(pe * 1315423911ll + idx * 2 + op))];
  clear_ps(e);
  e = fresh;
  Py_INCREF(a[0]);
  Py_INCREF(a[1]);
  Py_INCREF(a[3]);
  e.dst = a[0];
  e.src = a[1];
  e.sig = a[3];
  Py_RETURN_NONE;
}

// add_wait(sig, idx, cmp, addr)
PyObject* fp_add_wait(PyObject* self_, PyObject* const* a, Py_ssize_t n) {
  auto* self = reinterpret_cast<FastPath*>(self_);
  if (n != 4) {
    PyErr_SetString(PyExc_TypeError, "FastPath.add_wait: expected 4 arguments");
    return nullptr;
  }
  const long long idx = PyLong_AsLongLong(a[1]);
  const int cmp = static_cast<int>(PyLong_AsLong(a[2]));
  const uint64_t addr = PyLong_AsUnsignedLongLong(a[3]);
  if (PyErr_Occurred() || !check_mapped("signal_wait_until", "signal word", addr, 8)) return nullptr;
  WaitEntry& e = self->wait[mix(reinterpret_cast<uintptr_t>(a[0]), 0, 0, static_cast<uint64_t>(idx * 8 + cmp))];
  Py_INCREF(a[0]);
  Py_XSETREF(e.sig, a[0]);
  e.idx = idx;
  e.cmp = cmp;
  e.addr = addr;
  Py_RETURN_NONE;
}

void clear_entries(FastPath* self) {
  if (self->ps != nullptr)
    for (size_t i = 0; i < kSlots; ++i) clear_ps(self->ps[i]);
  if (self->wait != nullptr)
    for (size_t i = 0; i < kSlots; ++i) Py_CLEAR(self->wait[i].sig);
}

PyObject* fp_clear(PyObject* self_, PyObject*) {
  clear_entries(reinterpret_cast<FastPath*>(self_));
  Py_RETURN_NONE;
}

int fp_traverse(PyObject* self_, visitproc visit, void* arg) {
  auto* self = reinterpret_cast<FastPath*>(self_);
  Py_VISIT(Py_TYPE(self_));
  Py_VISIT(self->slow_put_signal);
  Py_VISIT(self->slow_wait);
  Py_VISIT(self->keep);
  if (self->ps != nullptr)
    for (size_t i = 0; i < kSlots; ++i) {
      Py_VISIT(self->ps[i].dst);
      Py_VISIT(self->ps[i].src);
      Py_VISIT(self->ps[i].sig);
    }
  if (self->wait != nullptr)
    for (size_t i = 0; i < kSlots; ++i) Py_VISIT(self->wait[i].sig);
  return 0;
}

int fp_clear_gc(PyObject* self_) {
  auto* self = reinterpret_cast<FastPath*>(self_);
  clear_entries(self);
  Py_CLEAR(self->slow_put_signal);
  Py_CLEAR(self->slow_wait);
  Py_CLEAR(self->keep);
  return 0;
}

void fp_dealloc(PyObject* self_) {
  auto* self = reinterpret_cast<FastPath*>(self_);
  PyTypeObject* tp = Py_TYPE(self_);
  PyObject_GC_UnTrack(self_);
  fp_clear_gc(self_);
  delete[] self->ps;
  delete[] self->wait;
  tp->tp_free(self_);
  Py_DECREF(tp);
}

// FastPath(slow_put_signal, slow_wait, group_obj, group_handle, local_ctrl, timeout)
int fp_init(PyObject* self_, PyObject* args, PyObject*) {
  auto* self = reinterpret_cast<FastPath*>(self_);
  PyObject *ps, *w, *keep;
  unsigned long long group, local;
  double timeout;
  if (!PyArg_ParseTuple(args, "OOOKKd", &ps, &w, &keep, &group, &local, &timeout)) return -1;
  if (!check_group("FastPath", group) || !check_mapped("FastPath", "control block", local, sizeof(Ctrl))) return -1;
  Py_INCREF(ps);
  Py_INCREF(w);
  Py_INCREF(keep);
  Py_XSETREF(self->slow_put_signal, ps);
  Py_XSETREF(self->slow_wait, w);
  Py_XSETREF(self->keep, keep);
  self->group = reinterpret_cast<const Group*>(group);
  self->local = reinterpret_cast<Ctrl*>(local);
  self->timeout = timeout;
  if (self->ps == nullptr) self->ps = new PsEntry[kSlots];
  if (self->wait == nullptr) self->wait = new WaitEntry[kSlots];
  return 0;
}

PyMethodDef fp_methods[] = {
    {"put_signal", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(fp_put_signal)),
     METH_FASTCALL | METH_KEYWORDS, "put_signal(dst, src, pe, sig, idx, value, op='set')"},
    {"signal_wait_until", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(fp_wait)),
     METH_FASTCALL | METH_KEYWORDS, "signal_wait_until(sig, idx, cmp, value, timeout=None)"},
    {"add_put_signal", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(fp_add_put_signal)),
     METH_FASTCALL, nullptr},
    {"add_wait", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(fp_add_wait)), METH_FASTCALL, nullptr},
    {"clear", fp_clear, METH_NOARGS, "Forget every registered call."},
    {nullptr, nullptr, 0, nullptr}};

PyType_Slot fp_slots[] = {{Py_tp_dealloc, reinterpret_cast<void*>(fp_dealloc)},
                          {Py_tp_traverse, reinterpret_cast<void*>(fp_traverse)},
                          {Py_tp_clear, reinterpret_cast<void*>(fp_clear_gc)},
                          {Py_tp_init, reinterpret_cast<void*>(fp_init)},
                          {Py_tp_new, reinterpret_cast<void*>(PyType_GenericNew)},
                          {Py_tp_methods, fp_methods},
                          {0, nullptr}};
PyType_Spec fp_spec = {"asap_comm._C.FastPath", sizeof(FastPath), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
                       fp_slots};

}  // namespace

bool register_fastpath_type(PyObject* module) {
  s_data_ptr = PyUnicode_InternFromString("data_ptr");
  s_set = PyUnicode_InternFromString("set");
  s_add = PyUnicode_InternFromString("add");
  for (int i = 0; i < 6; ++i) s_cmp[i] = PyUnicode_InternFromString(kCmpText[i]);
  PyObject* tp = PyType_FromSpec(&fp_spec);
  if (tp == nullptr) return false;
  return PyModule_AddObject(module, "FastPath", tp) == 0;
}

}  // namespace asap
