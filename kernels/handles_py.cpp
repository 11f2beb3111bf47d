// The one native form of put_signal and of the signal wait (see handles.hpp).
//
// _C.PreparedPutSignal / _C.PreparedWait are validated, persistent handles
// (the MPI analogue is a persistent request: MPI_Send_init + MPI_Start),
// built only by make_put_signal / make_wait, which check every address they
// are given. _C.FastPath is the generic calls' table of such handles: a call
// is matched by the identity of its objects in a small direct-mapped table
// (the entries hold references, so identities stay unique), the source's
// data_ptr() is re-read to catch a reallocated tensor, and the handle runs.
// Anything not matched goes to the Python validating path with the caller's
// exact arguments; that path builds the handle, registers it and runs it. So
// a generic call, a prepared call and a first call all run the same code and
// raise the same errors. These are plain CPython types with vectorcall,
// because a call through pybind11's generic dispatcher costs more than the
// operation itself.
#include <Python.h>
#include <structmember.h>

#include <cmath>
#include <cstring>

#include "asap_shm.hpp"
#include "handles.hpp"

namespace asap {

namespace {

PyObject* g_tensor = nullptr;    // torch.Tensor
PyObject* g_data_ptr = nullptr;  // torch.Tensor.data_ptr, the unbound method
PyCFunction g_data_ptr_fn = nullptr;  // its C function, when it is a METH_NOARGS method descriptor
PyObject *s_data_ptr, *s_is_cpu, *s_element_size, *s_shape, *s_stride, *s_set, *s_add;

PyObject* g_put_signal_type = nullptr;
PyObject* g_wait_type = nullptr;

bool is_int(PyObject* o) { return PyLong_Check(o) && !PyBool_Check(o); }

// An owned reference to o.<name>() / o.<name>.
PyObject* call0(PyObject* o, PyObject* name) { return PyObject_CallMethodNoArgs(o, name); }

// Reads `o`, an exact int, as uint64; false (no error set) when it is not one or does not fit.
// PyLong_AsUnsignedLong reads the digits directly, where PyLong_AsUnsignedLongLong takes CPython's generic
// byte-array path for values of two digits and more (addresses, large signal values): on the per-call path
// that difference is a sizeable part of the call.
static_assert(sizeof(unsigned long) == sizeof(uint64_t), "unsigned long must be 64 bits");

bool exact_u64(PyObject* o, uint64_t* out) {
  if (!PyLong_CheckExact(o)) return false;
  *out = PyLong_AsUnsignedLong(o);
  if (*out == static_cast<uint64_t>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return true;
}

bool exact_index(PyObject* o, long long* out) {
  if (!PyLong_CheckExact(o)) return false;
  int overflow = 0;
  *out = PyLong_AsLongLongAndOverflow(o, &overflow);
  return !overflow && *out >= 0;
}

// ------------------------------------------------------------------ PreparedPutSignal
struct PreparedPutSignal {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  const Group* group;
  uintptr_t src;  // the source's data_ptr() when the handle was built
  uint64_t nbytes;
  int op;
  int pe;
  bool remote;
  // same host: addresses in this process, checked against the mappings
  uint64_t dst, sig;
  Ctrl* owner;
  // another host: (region, offset) pairs, bounds-checked by the target
  uint32_t region, sig_region;
  uint64_t off, sig_off;
  PyObject* keep;  // tensors, mappings and the Group: alive as long as this is
};

// The operation itself: every path of put_signal that reaches native code ends here.
PyObject* run_put_signal(PreparedPutSignal* h, uint64_t value, uintptr_t src) {
  if (h->group->closed()) return raise_closed("put_signal");
  if (h->remote) {
    NetIface* net = h->group->net();
    if (net == nullptr) return raise_closed("put_signal");
    if (!net->put_signal_py(h->pe, h->region, h->off, src, h->nbytes, h->sig_region, h->sig_off, value, h->op))
      return nullptr;
    Py_RETURN_NONE;
  }
  if (h->nbytes) copy_bytes(reinterpret_cast<void*>(h->dst), reinterpret_cast<const void*>(src), h->nbytes);
  signal_update(reinterpret_cast<uint64_t*>(h->sig), value, h->op, h->owner);
  Py_RETURN_NONE;
}

// The arguments of a handle call: `names` (n of them), positional or keyword, the first required.
bool handle_args(const char* fn, PyObject* const* args, size_t nargsf, PyObject* kwnames, const char* const* names,
                 int n, PyObject** out) {
  const Py_ssize_t np = PyVectorcall_NARGS(nargsf);
  if (np > n) {
    PyErr_Format(PyExc_TypeError, "%s: a prepared handle takes at most %d arguments (%zd given)", fn, n, np);
    return false;
  }
  for (int i = 0; i < n; ++i) out[i] = i < np ? args[i] : nullptr;
  const Py_ssize_t nk = kwnames != nullptr ? PyTuple_GET_SIZE(kwnames) : 0;
  for (Py_ssize_t k = 0; k < nk; ++k) {
    PyObject* key = PyTuple_GET_ITEM(kwnames, k);
    int j = 0;
    while (j < n && PyUnicode_CompareWithASCIIString(key, names[j]) != 0) ++j;
    if (j == n) {
      PyErr_Format(PyExc_TypeError, "%s: unexpected keyword argument %R for a prepared handle", fn, key);
      return false;
    }
    if (out[j] != nullptr) {
      PyErr_Format(PyExc_TypeError, "%s: %s given twice", fn, names[j]);
      return false;
    }
    out[j] = args[np + k];
  }
  if (out[0] == nullptr) {
    PyErr_Format(PyExc_TypeError, "%s: missing the argument %s", fn, names[0]);
    return false;
  }
  return true;
}

const char* const kPutSignalCallArgs[] = {"value"};
const char* const kWaitCallArgs[] = {"value", "timeout"};

PyObject* put_signal_call(PyObject* self_, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* h = reinterpret_cast<PreparedPutSignal*>(self_);
  PyObject* a[1];
  uint64_t value;
  if (!handle_args("put_signal", args, nargsf, kwnames, kPutSignalCallArgs, 1, a) ||
      !parse_value("put_signal", a[0], &value))
    return nullptr;
  return run_put_signal(h, value, h->src);
}

void put_signal_dealloc(PyObject* self_) {
  auto* self = reinterpret_cast<PreparedPutSignal*>(self_);
  PyTypeObject* tp = Py_TYPE(self_);
  Py_XDECREF(self->keep);
  tp->tp_free(self_);
  Py_DECREF(tp);
}

// ------------------------------------------------------------------ PreparedWait
struct PreparedWait {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  uint64_t addr;
  int cmp;
  Ctrl* owner;
  double timeout;  // when a call gives none
  const Group* group;
  int dep;
  PyObject* keep;
  PyObject* what;  // str: the error text's prefix, completed by the awaited value
  PyObject* mask;  // bytes (dep == kDepSet) or nullptr
  char name[32];   // the call its errors name: what's text before the first ':'
};

PyObject* run_wait(PreparedWait* h, uint64_t value, double timeout) {
  if (h->group->closed()) return raise_closed(h->name);
  const uint8_t* mask = h->mask != nullptr ? reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(h->mask)) : nullptr;
  WaitResult r = wait_until(reinterpret_cast<const uint64_t*>(h->addr), h->cmp, value, h->owner, timeout, h->group,
                            h->dep, mask);
  if (r.status == kWaitOk) return PyLong_FromUnsignedLongLong(r.value);
  PyObject* what = PyUnicode_FromFormat("%U%llu", h->what, static_cast<unsigned long long>(value));
  raise_wait_error(r, timeout, what);
  Py_XDECREF(what);
  return nullptr;
}

PyObject* wait_call(PyObject* self_, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* h = reinterpret_cast<PreparedWait*>(self_);
  PyObject* a[2];
  uint64_t value;
  double timeout;
  if (!handle_args(h->name, args, nargsf, kwnames, kWaitCallArgs, 2, a) || !parse_value(h->name, a[0], &value) ||
      !parse_timeout(h->name, a[1], h->timeout, &timeout))
    return nullptr;
  return run_wait(h, value, timeout);
}

void wait_dealloc(PyObject* self_) {
  auto* self = reinterpret_cast<PreparedWait*>(self_);
  PyTypeObject* tp = Py_TYPE(self_);
  Py_XDECREF(self->keep);
  Py_XDECREF(self->what);
  Py_XDECREF(self->mask);
  tp->tp_free(self_);
  Py_DECREF(tp);
}

PyMemberDef put_signal_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(PreparedPutSignal, vectorcall), READONLY, nullptr},
    {"nbytes", T_ULONGLONG, offsetof(PreparedPutSignal, nbytes), READONLY, "bytes copied per call"},
    {"pe", T_INT, offsetof(PreparedPutSignal, pe), READONLY, "target PE"},
    {"remote", T_BOOL, offsetof(PreparedPutSignal, remote), READONLY, "True: the target is on another host"},
    {nullptr, 0, 0, 0, nullptr}};
PyMemberDef wait_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(PreparedWait, vectorcall), READONLY, nullptr},
    {"timeout", T_DOUBLE, offsetof(PreparedWait, timeout), READONLY, "seconds, when a call gives none"},
    {nullptr, 0, 0, 0, nullptr}};

PyType_Slot put_signal_slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(put_signal_dealloc)},
    {Py_tp_call, reinterpret_cast<void*>(PyVectorcall_Call)},
    {Py_tp_members, put_signal_members},
    {Py_tp_doc, const_cast<char*>("A validated put_signal (Communicator.prepare_put_signal); call it with the value.")},
    {0, nullptr}};
PyType_Slot wait_slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(wait_dealloc)},
    {Py_tp_call, reinterpret_cast<void*>(PyVectorcall_Call)},
    {Py_tp_members, wait_members},
    {Py_tp_doc, const_cast<char*>("A validated signal wait (Communicator.prepare_signal_wait); call it with the "
                                  "value and optionally timeout=.")},
    {0, nullptr}};

#ifndef Py_TPFLAGS_HAVE_VECTORCALL
#define Py_TPFLAGS_HAVE_VECTORCALL _Py_TPFLAGS_HAVE_VECTORCALL
#endif

PyType_Spec put_signal_spec = {"asap_comm._C.PreparedPutSignal", sizeof(PreparedPutSignal), 0,
                               Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL, put_signal_slots};
PyType_Spec wait_spec = {"asap_comm._C.PreparedWait", sizeof(PreparedWait), 0,
                         Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL, wait_slots};

// ------------------------------------------------------------------ FastPath
constexpr size_t kSlots = 64;  // power of two

struct PsEntry {
  PyObject* dst = nullptr;  // owned references: identity keys
  PyObject* src = nullptr;
  PyObject* sig = nullptr;
  PyObject* handle = nullptr;  // PreparedPutSignal
  long long pe = 0, idx = 0;
  int op = 0;
};

struct WaitEntry {
  PyObject* sig = nullptr;
  PyObject* handle = nullptr;  // PreparedWait
  long long idx = 0;
  int cmp = 0;
};

struct FastPath {
  PyObject_HEAD
  PyObject* slow_put_signal;  // Communicator._put_signal_slow
  PyObject* slow_wait;        // Communicator._signal_wait_slow
  PyObject* keep;             // the Group object
  const Group* group;
  PsEntry* ps;      // kSlots
  WaitEntry* wait;  // kSlots
};

inline size_t mix(uintptr_t a, uintptr_t b, uintptr_t c, uint64_t d) {
  uint64_t h = a * 0x9E3779B97F4A7C15ull ^ (b >> 4) * 0xC2B2AE3D27D4EB4Full ^ (c >> 4) * 0x165667B19E3779F9ull ^
               d * 0x27D4EB2F165667C5ull;
  return static_cast<size_t>((h ^ (h >> 29)) & (kSlots - 1));
}
inline size_t ps_slot(PyObject* dst, PyObject* src, PyObject* sig, long long pe, long long idx, int op) {
  return mix(reinterpret_cast<uintptr_t>(dst), reinterpret_cast<uintptr_t>(src), reinterpret_cast<uintptr_t>(sig),
             static_cast<uint64_t>(pe * 1315423911ll + idx * 2 + op));
}
inline size_t wait_slot(PyObject* sig, long long idx, int cmp) {
  return mix(reinterpret_cast<uintptr_t>(sig), 0, 0, static_cast<uint64_t>(idx * 8 + cmp));
}

void clear_ps(PsEntry& e) {
  Py_CLEAR(e.dst);
  Py_CLEAR(e.src);
  Py_CLEAR(e.sig);
  Py_CLEAR(e.handle);
}
void clear_wait(WaitEntry& e) {
  Py_CLEAR(e.sig);
  Py_CLEAR(e.handle);
}

int op_code(PyObject* o) {  // -1: not "set"/"add"
  if (o == s_set) return 0;
  if (o == s_add) return 1;
  if (!PyUnicode_Check(o)) return -1;
  if (PyUnicode_CompareWithASCIIString(o, "set") == 0) return 0;
  if (PyUnicode_CompareWithASCIIString(o, "add") == 0) return 1;
  return -1;
}

// Comparison strings in call sites are constants but not interned (they are not identifiers), so the text is
// read directly rather than compared string by string.
int cmp_code(PyObject* o) {
  if (!PyUnicode_Check(o) || !PyUnicode_IS_COMPACT_ASCII(o)) return -1;
  const Py_ssize_t n = PyUnicode_GET_LENGTH(o);
  const char* c = reinterpret_cast<const char*>(PyUnicode_DATA(o));
  if (n == 1) return c[0] == '>' ? 2 : c[0] == '<' ? 4 : -1;
  if (n != 2 || c[1] != '=') return -1;
  switch (c[0]) {
    case '=': return 0;
    case '!': return 1;
    case '>': return 3;
    case '<': return 5;
    default: return -1;
  }
}

// Lays a vectorcall's positional and keyword arguments out by parameter (``names``, ``n`` of them) into
// ``out``; an absent parameter is nullptr. False (the call goes to the validating slow path, which raises the
// proper TypeError) on too many arguments, an unknown keyword or a parameter given twice.
bool arrange(PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames, const char* const* names,
             PyObject* const* interned, int n, PyObject** out) {
  if (nargs > n) return false;
  for (int i = 0; i < n; ++i) out[i] = i < nargs ? args[i] : nullptr;
  if (kwnames == nullptr) return true;
  const Py_ssize_t nk = PyTuple_GET_SIZE(kwnames);
  for (Py_ssize_t k = 0; k < nk; ++k) {
    PyObject* key = PyTuple_GET_ITEM(kwnames, k);
    int j = static_cast<int>(nargs);
    while (j < n && key != interned[j]) ++j;  // keywords in call sites are interned: identity first
    if (j == n) {
      j = static_cast<int>(nargs);
      while (j < n && PyUnicode_CompareWithASCIIString(key, names[j]) != 0) ++j;
    }
    if (j == n || out[j] != nullptr) return false;
    out[j] = args[nargs + k];
  }
  return true;
}

const char* const kPutSignalParams[] = {"dst", "src", "pe", "sig", "idx", "value", "op"};
const char* const kWaitParams[] = {"sig", "idx", "cmp", "value", "timeout"};
PyObject* s_put_signal_params[7];
PyObject* s_wait_params[5];

// put_signal(dst, src, pe, sig, idx, value, op="set"): any mix of positional and keyword arguments
PyObject* fp_put_signal(PyObject* self_, PyObject* const* in, Py_ssize_t nargs, PyObject* kwnames) {
  auto* self = reinterpret_cast<FastPath*>(self_);
  auto slow = [&] { return PyObject_Vectorcall(self->slow_put_signal, in, static_cast<size_t>(nargs), kwnames); };
  PyObject* args[7];
  if (!arrange(in, nargs, kwnames, kPutSignalParams, s_put_signal_params, 7, args)) return slow();
  for (int i = 0; i < 6; ++i)
    if (args[i] == nullptr) return slow();
  long long pe, idx;
  uint64_t value;
  const int op = args[6] != nullptr ? op_code(args[6]) : 0;
  if (op < 0 || !exact_index(args[2], &pe) || !exact_index(args[4], &idx) || !exact_u64(args[5], &value))
    return slow();
  PsEntry& e = self->ps[ps_slot(args[0], args[1], args[3], pe, idx, op)];
  if (e.dst != args[0] || e.src != args[1] || e.sig != args[3] || e.pe != pe || e.idx != idx || e.op != op)
    return slow();
  auto* h = reinterpret_cast<PreparedPutSignal*>(e.handle);
  uintptr_t src = h->src;
  if (h->nbytes) {
    // torch.Tensor.data_ptr(src), straight through the method's C function when it is a plain no-argument one
    PyObject* p = g_data_ptr_fn != nullptr && Py_TYPE(args[1]) == reinterpret_cast<PyTypeObject*>(g_tensor)
                      ? g_data_ptr_fn(args[1], nullptr)
                      : call0(args[1], s_data_ptr);
    if (p == nullptr) return nullptr;
    src = PyLong_AsUnsignedLong(p);
    Py_DECREF(p);
    if (PyErr_Occurred()) return nullptr;
    if (src != h->src) {  // the source was reallocated: validate again
      clear_ps(e);
      return slow();
    }
  }
  return run_put_signal(h, value, src);
}

// signal_wait_until(sig, idx, cmp, value, timeout=None): any mix of positional and keyword arguments (peers=
// goes to the slow path)
PyObject* fp_wait(PyObject* self_, PyObject* const* in, Py_ssize_t nargs, PyObject* kwnames) {
  auto* self = reinterpret_cast<FastPath*>(self_);
  auto slow = [&] { return PyObject_Vectorcall(self->slow_wait, in, static_cast<size_t>(nargs), kwnames); };
  PyObject* args[5];
  if (!arrange(in, nargs, kwnames, kWaitParams, s_wait_params, 5, args) || args[0] == nullptr ||
      args[1] == nullptr || args[2] == nullptr || args[3] == nullptr)
    return slow();
  long long idx;
  uint64_t value;
  const int cmp = cmp_code(args[2]);
  if (cmp < 0 || !exact_index(args[1], &idx) || !exact_u64(args[3], &value)) return slow();
  WaitEntry& e = self->wait[wait_slot(args[0], idx, cmp)];
  if (e.sig != args[0] || e.idx != idx || e.cmp != cmp) return slow();
  auto* h = reinterpret_cast<PreparedWait*>(e.handle);
  double timeout = h->timeout;
  PyObject* t = args[4];
  if (t != nullptr && t != Py_None) {
    if (PyFloat_CheckExact(t))
      timeout = PyFloat_AS_DOUBLE(t);
    else if (PyLong_CheckExact(t))
      timeout = PyLong_AsDouble(t);
    else
      return slow();
    if (timeout == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      return slow();
    }
    if (!(timeout >= 0.0) || std::isinf(timeout)) return slow();
  }
  return run_wait(h, value, timeout);
}

// add_put_signal(dst, src, pe, sig, idx, op, handle): later calls with these objects run `handle`
PyObject* fp_add_put_signal(PyObject* self_, PyObject* const* a, Py_ssize_t n) {
  auto* self = reinterpret_cast<FastPath*>(self_);
  long long pe, idx;
  if (n != 7 || !exact_index(a[2], &pe) || !exact_index(a[4], &idx) || !PyLong_CheckExact(a[5]) ||
      Py_TYPE(a[6]) != reinterpret_cast<PyTypeObject*>(g_put_signal_type)) {
    PyErr_SetString(PyExc_TypeError, "FastPath.add_put_signal(dst, src, pe, sig, idx, op, handle)");
    return nullptr;
  }
  const int op = static_cast<int>(PyLong_AsLong(a[5]));
  auto* h = reinterpret_cast<PreparedPutSignal*>(a[6]);
  if (h->group != self->group || h->pe != pe || h->op != op) {
    PyErr_SetString(PyExc_ValueError, "FastPath.add_put_signal: the handle was built for another call");
    return nullptr;
  }
  PsEntry& e = self->ps[ps_slot(a[0], a[1], a[3], pe, idx, op)];
  clear_ps(e);
  e.pe = pe;
  e.idx = idx;
  e.op = op;
  PyObject* objs[4] = {a[0], a[1], a[3], a[6]};
  for (PyObject* o : objs) Py_INCREF(o);
  e.dst = a[0];
  e.src = a[1];
  e.sig = a[3];
  e.handle = a[6];
  Py_RETURN_NONE;
}

// add_wait(sig, idx, cmp, handle)
PyObject* fp_add_wait(PyObject* self_, PyObject* const* a, Py_ssize_t n) {
  auto* self = reinterpret_cast<FastPath*>(self_);
  long long idx;
  if (n != 4 || !exact_index(a[1], &idx) || !PyLong_CheckExact(a[2]) ||
      Py_TYPE(a[3]) != reinterpret_cast<PyTypeObject*>(g_wait_type)) {
    PyErr_SetString(PyExc_TypeError, "FastPath.add_wait(sig, idx, cmp, handle)");
    return nullptr;
  }
  const int cmp = static_cast<int>(PyLong_AsLong(a[2]));
  auto* h = reinterpret_cast<PreparedWait*>(a[3]);
  if (h->group != self->group || h->cmp != cmp || h->dep != kDepAny) {
    PyErr_SetString(PyExc_ValueError, "FastPath.add_wait: the handle was built for another call");
    return nullptr;
  }
  WaitEntry& e = self->wait[wait_slot(a[0], idx, cmp)];
  clear_wait(e);
  Py_INCREF(a[0]);
  Py_INCREF(a[3]);
  e.sig = a[0];
  e.handle = a[3];
  e.idx = idx;
  e.cmp = cmp;
  Py_RETURN_NONE;
}

// The handles registered now: (put_signal handles, wait handles), for tests and introspection.
PyObject* fp_handles(PyObject* self_, PyObject*) {
  auto* self = reinterpret_cast<FastPath*>(self_);
  PyObject* ps = PyList_New(0);
  PyObject* w = PyList_New(0);
  if (ps == nullptr || w == nullptr) {
    Py_XDECREF(ps);
    Py_XDECREF(w);
    return nullptr;
  }
  for (size_t i = 0; i < kSlots; ++i) {
    if (self->ps[i].handle != nullptr && PyList_Append(ps, self->ps[i].handle) != 0) goto fail;
    if (self->wait[i].handle != nullptr && PyList_Append(w, self->wait[i].handle) != 0) goto fail;
  }
  return Py_BuildValue("(NN)", ps, w);
fail:
  Py_DECREF(ps);
  Py_DECREF(w);
  return nullptr;
}

void clear_entries(FastPath* self) {
  if (self->ps != nullptr)
    for (size_t i = 0; i < kSlots; ++i) clear_ps(self->ps[i]);
  if (self->wait != nullptr)
    for (size_t i = 0; i < kSlots; ++i) clear_wait(self->wait[i]);
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
      Py_VISIT(self->ps[i].handle);
    }
  if (self->wait != nullptr)
    for (size_t i = 0; i < kSlots; ++i) {
      Py_VISIT(self->wait[i].sig);
      Py_VISIT(self->wait[i].handle);
    }
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

// FastPath(slow_put_signal, slow_wait, group_obj, group_handle)
int fp_init(PyObject* self_, PyObject* args, PyObject*) {
  auto* self = reinterpret_cast<FastPath*>(self_);
  PyObject *ps, *w, *keep;
  unsigned long long group;
  if (!PyArg_ParseTuple(args, "OOOK", &ps, &w, &keep, &group)) return -1;
  if (!check_group("FastPath", group)) return -1;
  Py_INCREF(ps);
  Py_INCREF(w);
  Py_INCREF(keep);
  Py_XSETREF(self->slow_put_signal, ps);
  Py_XSETREF(self->slow_wait, w);
  Py_XSETREF(self->keep, keep);
  self->group = reinterpret_cast<const Group*>(group);
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
     METH_FASTCALL, "add_put_signal(dst, src, pe, sig, idx, op, handle)"},
    {"add_wait", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(fp_add_wait)), METH_FASTCALL,
     "add_wait(sig, idx, cmp, handle)"},
    {"handles", fp_handles, METH_NOARGS, "(put_signal handles, wait handles) registered now."},
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

// A (region, offset) pair for a PE on another host.
bool region_pair(const char* fn, const char* name, PyObject* o, uint32_t* region, uint64_t* off) {
  if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) != 2) {
    PyErr_Format(PyExc_TypeError, "%s: %s of a PE on another host must be a (region, offset) pair", fn, name);
    return false;
  }
  *region = static_cast<uint32_t>(PyLong_AsUnsignedLong(PyTuple_GET_ITEM(o, 0)));
  *off = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(o, 1));
  return !PyErr_Occurred();
}

}  // namespace

// ------------------------------------------------------------------ shared helpers
PyObject* raise_closed(const char* fn) {
  PyErr_Format(comm_error_type(), "%s: the communicator is closed", fn);
  return nullptr;
}

PyObject* tensor_type() { return g_tensor; }
void set_tensor_type(PyObject* t) {
  Py_XINCREF(t);
  Py_XSETREF(g_tensor, t);
  Py_CLEAR(g_data_ptr);
  if (t != nullptr) {
    g_data_ptr = PyObject_GetAttr(t, s_data_ptr);
    if (g_data_ptr == nullptr) PyErr_Clear();
  }
  g_data_ptr_fn = nullptr;
  if (g_data_ptr != nullptr && Py_IS_TYPE(g_data_ptr, &PyMethodDescr_Type)) {
    const PyMethodDef* def = reinterpret_cast<PyMethodDescrObject*>(g_data_ptr)->d_method;
    if ((def->ml_flags & (METH_VARARGS | METH_FASTCALL | METH_NOARGS | METH_O | METH_KEYWORDS)) == METH_NOARGS)
      g_data_ptr_fn = def->ml_meth;
  }
}

bool tensor_span(PyObject* t, const char* fn, const char* name, uint64_t off, uint64_t n, uintptr_t* addr) {
  if (g_tensor == nullptr || !PyObject_TypeCheck(t, reinterpret_cast<PyTypeObject*>(g_tensor))) {
    PyErr_Format(PyExc_TypeError, "%s: %s must be a torch.Tensor, got %s", fn, name, Py_TYPE(t)->tp_name);
    return false;
  }
  PyObject* cpu = PyObject_GetAttr(t, s_is_cpu);
  if (cpu == nullptr) return false;
  Py_DECREF(cpu);
  if (cpu != Py_True) {
    PyErr_Format(PyExc_ValueError, "%s: %s is not a CPU tensor", fn, name);
    return false;
  }
  PyObject* p = call0(t, s_data_ptr);
  PyObject* es = p != nullptr ? call0(t, s_element_size) : nullptr;
  PyObject* shape = es != nullptr ? PyObject_GetAttr(t, s_shape) : nullptr;
  PyObject* stride = shape != nullptr ? call0(t, s_stride) : nullptr;
  bool ok = stride != nullptr && PyTuple_Check(shape) && PyTuple_Check(stride) &&
            PyTuple_GET_SIZE(shape) == PyTuple_GET_SIZE(stride);
  uint64_t extent = 0;
  uintptr_t base = 0;
  if (ok) {
    base = PyLong_AsUnsignedLongLong(p);
    unsigned __int128 last = 0;  // offset of the last element, in elements
    bool empty = false;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(shape); ++i) {
      const long long sz = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
      const long long st = PyLong_AsLongLong(PyTuple_GET_ITEM(stride, i));
      if (sz == 0) empty = true;
      if (sz > 0 && st < 0) ok = false;  // torch has no negative strides; refuse rather than guess
      if (sz > 0 && st > 0) last += static_cast<unsigned __int128>(sz - 1) * static_cast<uint64_t>(st);
    }
    const unsigned __int128 bytes = (last + 1) * PyLong_AsUnsignedLongLong(es);
    extent = empty ? 0 : (bytes > UINT64_MAX ? UINT64_MAX : static_cast<uint64_t>(bytes));
    if (PyErr_Occurred()) ok = false;
  }
  Py_XDECREF(p);
  Py_XDECREF(es);
  Py_XDECREF(shape);
  Py_XDECREF(stride);
  if (!ok) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "%s: cannot read the layout of %s", fn, name);
    return false;
  }
  if (off > extent || n > extent - off) {
    PyErr_Format(PyExc_ValueError, "%s: bytes [%llu, %llu) of %s lie outside the %llu bytes the tensor spans", fn,
                 static_cast<unsigned long long>(off), static_cast<unsigned long long>(off + n), name,
                 static_cast<unsigned long long>(extent));
    return false;
  }
  *addr = base + off;
  return true;
}

bool parse_value(const char* fn, PyObject* v, uint64_t* out) {
  if (!is_int(v)) {
    PyErr_Format(PyExc_TypeError, "%s: value must be an int, got %s", fn, Py_TYPE(v)->tp_name);
    return false;
  }
  *out = PyLong_AsUnsignedLong(v);
  if (*out == static_cast<uint64_t>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    PyErr_Format(PyExc_ValueError, "%s: value=%R does not fit an unsigned 64-bit signal word", fn, v);
    return false;
  }
  return true;
}

bool parse_timeout(const char* fn, PyObject* t, double fallback, double* out) {
  if (t == nullptr || t == Py_None) {
    *out = fallback;
    return true;
  }
  if (!PyFloat_Check(t) && !is_int(t)) {
    PyErr_Format(PyExc_TypeError, "%s: timeout must be a number of seconds or None, got %R", fn, t);
    return false;
  }
  const double v = PyFloat_Check(t) ? PyFloat_AS_DOUBLE(t) : PyLong_AsDouble(t);
  if (v == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();
    PyErr_Format(PyExc_ValueError, "%s: timeout must be finite and >= 0, got %R", fn, t);
    return false;
  }
  if (!(v >= 0.0) || std::isinf(v)) {
    PyErr_Format(PyExc_ValueError, "%s: timeout must be finite and >= 0, got %R", fn, t);
    return false;
  }
  *out = v;
  return true;
}

bool register_handle_types(PyObject* module) {
  s_data_ptr = PyUnicode_InternFromString("data_ptr");
  s_is_cpu = PyUnicode_InternFromString("is_cpu");
  s_element_size = PyUnicode_InternFromString("element_size");
  s_shape = PyUnicode_InternFromString("shape");
  s_stride = PyUnicode_InternFromString("stride");
  s_set = PyUnicode_InternFromString("set");
  s_add = PyUnicode_InternFromString("add");
  for (int i = 0; i < 7; ++i) s_put_signal_params[i] = PyUnicode_InternFromString(kPutSignalParams[i]);
  for (int i = 0; i < 5; ++i) s_wait_params[i] = PyUnicode_InternFromString(kWaitParams[i]);
  g_put_signal_type = PyType_FromSpec(&put_signal_spec);
  g_wait_type = PyType_FromSpec(&wait_spec);
  PyObject* fp = PyType_FromSpec(&fp_spec);
  if (g_put_signal_type == nullptr || g_wait_type == nullptr || fp == nullptr) return false;
  Py_INCREF(g_put_signal_type);
  Py_INCREF(g_wait_type);
  return PyModule_AddObject(module, "PreparedPutSignal", g_put_signal_type) == 0 &&
         PyModule_AddObject(module, "PreparedWait", g_wait_type) == 0 &&
         PyModule_AddObject(module, "FastPath", fp) == 0;
}

// make_put_signal(fn, group, pe, src, nbytes, op, dst, sig, owner, keep) -> PreparedPutSignal
//   The one builder of a put_signal. Same host: dst and sig are addresses in this process (checked against the
//   live mappings) and owner the target's control block; another host: dst and sig are (region, offset) pairs
//   and owner is 0. src is the source tensor: its address is read from it, and nbytes must lie inside it.
PyObject* make_put_signal(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (n != 10 || !PyUnicode_Check(a[0])) {
    PyErr_SetString(PyExc_TypeError, "_C.make_put_signal(fn, group, pe, src, nbytes, op, dst, sig, owner, keep)");
    return nullptr;
  }
  const char* fn = PyUnicode_AsUTF8(a[0]);
  const uint64_t group = PyLong_AsUnsignedLongLong(a[1]);
  const long pe = PyLong_AsLong(a[2]);
  const uint64_t nbytes = PyLong_AsUnsignedLongLong(a[4]);
  const long op = PyLong_AsLong(a[5]);
  if (fn == nullptr || PyErr_Occurred() || !check_group(fn, group)) return nullptr;
  const auto* g = reinterpret_cast<const Group*>(group);
  if (pe < 0 || pe >= g->world_size() || (op != 0 && op != 1)) {
    PyErr_Format(PyExc_ValueError, "%s: pe=%ld or op=%ld out of range", fn, pe, op);
    return nullptr;
  }
  uintptr_t src = 0;
  if (nbytes != 0 && !tensor_span(a[3], fn, "src", 0, nbytes, &src)) return nullptr;
  auto* tp = reinterpret_cast<PyTypeObject*>(g_put_signal_type);
  auto* h = reinterpret_cast<PreparedPutSignal*>(tp->tp_alloc(tp, 0));
  if (h == nullptr) return nullptr;
  h->vectorcall = put_signal_call;
  h->group = g;
  h->src = src;
  h->nbytes = nbytes;
  h->op = static_cast<int>(op);
  h->pe = static_cast<int>(pe);
  h->remote = g->is_remote(static_cast<int>(pe));
  Py_INCREF(a[9]);
  h->keep = a[9];
  bool ok;
  if (h->remote) {
    ok = region_pair(fn, "dst", a[6], &h->region, &h->off) && region_pair(fn, "sig", a[7], &h->sig_region, &h->sig_off);
    if (ok && nbytes == 0) {  // nothing to copy: the message names the signal's region
      h->region = h->sig_region;
      h->off = h->sig_off;
    }
  } else {
    h->dst = nbytes != 0 ? PyLong_AsUnsignedLongLong(a[6]) : 0;
    h->sig = PyLong_AsUnsignedLongLong(a[7]);
    h->owner = reinterpret_cast<Ctrl*>(PyLong_AsUnsignedLongLong(a[8]));
    ok = !PyErr_Occurred() && (nbytes == 0 || check_mapped(fn, "destination", h->dst, nbytes)) &&
         check_mapped(fn, "signal word", h->sig, 8) &&
         check_mapped(fn, "control block", reinterpret_cast<uintptr_t>(h->owner), sizeof(Ctrl));
  }
  if (!ok) {
    Py_DECREF(h);
    return nullptr;
  }
  return reinterpret_cast<PyObject*>(h);
}

// make_wait(fn, group, addr, cmp, owner, timeout, dep, mask, what, keep) -> PreparedWait
//   The one builder of a signal wait: the word at `addr` (checked against the live mappings) compared with
//   `cmp` (0..5: == != > >= < <=); `timeout` when a call gives none; dep DEP_ANY/DEP_ALL/DEP_BARRIER (the
//   awaited value is the barrier round), or DEP_SET with
//   `mask` (bytes, one per PE); `what` prefixes error texts (the awaited value is appended).
PyObject* make_wait(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (n != 10 || !PyUnicode_Check(a[0]) || !PyUnicode_Check(a[8]) || (a[7] != Py_None && !PyBytes_Check(a[7]))) {
    PyErr_SetString(PyExc_TypeError,
                    "_C.make_wait(fn, group, addr, cmp, owner, timeout, dep, mask: bytes | None, what: str, keep)");
    return nullptr;
  }
  const char* fn = PyUnicode_AsUTF8(a[0]);
  const uint64_t group = PyLong_AsUnsignedLongLong(a[1]);
  if (fn == nullptr || PyErr_Occurred() || !check_group(fn, group)) return nullptr;
  const auto* g = reinterpret_cast<const Group*>(group);
  const uint64_t addr = PyLong_AsUnsignedLongLong(a[2]);
  const long cmp = PyLong_AsLong(a[3]);
  const uint64_t owner = PyLong_AsUnsignedLongLong(a[4]);
  const long dep = PyLong_AsLong(a[6]);
  double timeout;
  if (PyErr_Occurred() || !parse_timeout(fn, a[5], 0.0, &timeout)) return nullptr;
  if (cmp < 0 || cmp > 5 || (dep != kDepAny && dep != kDepAll && dep != kDepSet && dep != kDepBarrier) ||
      ((dep == kDepSet) != (a[7] != Py_None)) ||
      (a[7] != Py_None && PyBytes_GET_SIZE(a[7]) != g->world_size())) {
    PyErr_Format(PyExc_ValueError, "%s: cmp=%ld, dep=%ld or the PE mask out of range", fn, cmp, dep);
    return nullptr;
  }
  if (!check_mapped(fn, "signal word", addr, 8) || !check_mapped(fn, "control block", owner, sizeof(Ctrl)))
    return nullptr;
  auto* tp = reinterpret_cast<PyTypeObject*>(g_wait_type);
  auto* h = reinterpret_cast<PreparedWait*>(tp->tp_alloc(tp, 0));
  if (h == nullptr) return nullptr;
  h->vectorcall = wait_call;
  h->addr = addr;
  h->cmp = static_cast<int>(cmp);
  h->owner = reinterpret_cast<Ctrl*>(owner);
  h->timeout = timeout;
  h->group = g;
  h->dep = static_cast<int>(dep);
  Py_INCREF(a[9]);
  h->keep = a[9];
  Py_INCREF(a[8]);
  h->what = a[8];
  const char* w = PyUnicode_AsUTF8(a[8]);
  size_t len = w != nullptr ? std::strcspn(w, ":") : 0;
  if (len >= sizeof h->name) len = sizeof h->name - 1;
  std::memcpy(h->name, w != nullptr ? w : "", len);
  h->name[len] = '\0';
  PyErr_Clear();
  if (a[7] != Py_None) {
    Py_INCREF(a[7]);
    h->mask = a[7];
  }
  return reinterpret_cast<PyObject*>(h);
}

}  // namespace asap
