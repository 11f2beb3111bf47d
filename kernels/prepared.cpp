// Prepared (persistent) operations: a put_signal or a signal wait whose
// arguments were validated once in Python, called with only the value that
// changes. The MPI analogue is a persistent request (MPI_Send_init +
// MPI_Start). They are plain CPython types with vectorcall, because a call
// through pybind11's generic dispatcher costs more than the operation.
#include <Python.h>
#include <structmember.h>

#include "asap_shm.hpp"
#include "prepared.hpp"

namespace asap {

namespace {

struct PreparedPutSignal {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  uint64_t dst, src, nbytes, sig;
  int op;
  Ctrl* owner;
  const Group* group;
  PyObject* keep;  // tensors, mappings and the Group: alive as long as this is
};

struct PreparedWait {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  uint64_t addr;
  int cmp;
  Ctrl* owner;
  double timeout;
  const Group* group;
  int dep;
  PyObject* keep;
  PyObject* what;  // str for error messages
  PyObject* mask;  // bytes (dep == kDepSet) or nullptr
};

PyObject* g_put_signal_type = nullptr;
PyObject* g_wait_type = nullptr;

// The one argument of a prepared call: `value`, positional or keyword.
bool value_arg(const char* fn, PyObject* const* args, size_t nargsf, PyObject* kwnames, uint64_t* out) {
  const Py_ssize_t n = PyVectorcall_NARGS(nargsf);
  const Py_ssize_t nk = kwnames != nullptr ? PyTuple_GET_SIZE(kwnames) : 0;
  if (n + nk != 1) {
    PyErr_Format(PyExc_TypeError, "%s: takes exactly one argument, value (%zd given)", fn, n + nk);
    return false;
  }
  if (nk == 1 && PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "value") != 0) {
    PyErr_Format(PyExc_TypeError, "%s: unexpected keyword argument %R (the one argument is value)", fn,
                 PyTuple_GET_ITEM(kwnames, 0));
    return false;
  }
  PyObject* v = args[0];
  if (!PyLong_Check(v) || PyBool_Check(v)) {
    PyErr_Format(PyExc_TypeError, "%s: value must be an int, got %s", fn, Py_TYPE(v)->tp_name);
    return false;
  }
  *out = PyLong_AsUnsignedLongLong(v);
  if (PyErr_Occurred()) {
    PyErr_Clear();
    PyErr_Format(PyExc_ValueError, "%s: value=%R does not fit an unsigned 64-bit signal word", fn, v);
    return false;
  }
  return true;
}

PyObject* put_signal_call(PyObject* self_, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* self = reinterpret_cast<PreparedPutSignal*>(self_);
  uint64_t value;
  if (!value_arg("PreparedPutSignal", args, nargsf, kwnames, &value)) return nullptr;
  if (self->group->closed()) {
    PyErr_SetString(comm_error_type(), "PreparedPutSignal: the communicator is closed");
    return nullptr;
  }
  if (self->nbytes) copy_bytes(reinterpret_cast<void*>(self->dst), reinterpret_cast<const void*>(self->src), self->nbytes);
  signal_update(reinterpret_cast<uint64_t*>(self->sig), value, self->op, self->owner);
  Py_RETURN_NONE;
}

PyObject* wait_call(PyObject* self_, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* self = reinterpret_cast<PreparedWait*>(self_);
  uint64_t value;
  if (!value_arg("PreparedWait", args, nargsf, kwnames, &value)) return nullptr;
  if (self->group->closed()) {
    PyErr_SetString(comm_error_type(), "PreparedWait: the communicator is closed");
    return nullptr;
  }
  const uint8_t* mask =
      self->mask != nullptr ? reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(self->mask)) : nullptr;
  WaitResult r = wait_until(reinterpret_cast<const uint64_t*>(self->addr), self->cmp, value, self->owner,
                            self->timeout, self->group, self->dep, mask);
  if (r.status == kWaitOk) return PyLong_FromUnsignedLongLong(r.value);
  PyObject* what = PyUnicode_FromFormat("%U %llu", self->what, static_cast<unsigned long long>(value));
  raise_wait_error(r, self->timeout, what);
  Py_XDECREF(what);
  return nullptr;
}

void put_signal_dealloc(PyObject* self_) {
  auto* self = reinterpret_cast<PreparedPutSignal*>(self_);
  PyTypeObject* tp = Py_TYPE(self_);
  Py_XDECREF(self->keep);
  tp->tp_free(self_);
  Py_DECREF(tp);
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
    {nullptr, 0, 0, 0, nullptr}};
PyMemberDef wait_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(PreparedWait, vectorcall), READONLY, nullptr},
    {nullptr, 0, 0, 0, nullptr}};

PyType_Slot put_signal_slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(put_signal_dealloc)},
    {Py_tp_call, reinterpret_cast<void*>(PyVectorcall_Call)},
    {Py_tp_members, put_signal_members},
    {Py_tp_doc, const_cast<char*>("put_signal prepared by Communicator.prepare_put_signal; call it with the value.")},
    {0, nullptr}};
PyType_Slot wait_slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(wait_dealloc)},
    {Py_tp_call, reinterpret_cast<void*>(PyVectorcall_Call)},
    {Py_tp_members, wait_members},
    {Py_tp_doc, const_cast<char*>("signal wait prepared by Communicator.prepare_signal_wait; call it with the value.")},
    {0, nullptr}};

#ifndef Py_TPFLAGS_HAVE_VECTORCALL
#define Py_TPFLAGS_HAVE_VECTORCALL _Py_TPFLAGS_HAVE_VECTORCALL
#endif

PyType_Spec put_signal_spec = {"asap_comm._C.PreparedPutSignal", sizeof(PreparedPutSignal), 0,
                               Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL, put_signal_slots};
PyType_Spec wait_spec = {"asap_comm._C.PreparedWait", sizeof(PreparedWait), 0,
                         Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL, wait_slots};

}  // namespace

bool register_prepared_types(PyObject* module) {
  g_put_signal_type = PyType_FromSpec(&put_signal_spec);
  g_wait_type = PyType_FromSpec(&wait_spec);
  if (g_put_signal_type == nullptr || g_wait_type == nullptr) return false;
  Py_INCREF(g_put_signal_type);
  Py_INCREF(g_wait_type);
  return PyModule_AddObject(module, "PreparedPutSignal", g_put_signal_type) == 0 &&
         PyModule_AddObject(module, "PreparedWait", g_wait_type) == 0;
}

// make_put_signal(dst, src, nbytes, sig, op, owner_ctrl, group, keep)
PyObject* make_put_signal(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (n != 8) {
    PyErr_SetString(PyExc_TypeError, "_C.make_put_signal: expected 8 arguments");
    return nullptr;
  }
  auto* tp = reinterpret_cast<PyTypeObject*>(g_put_signal_type);
  auto* self = reinterpret_cast<PreparedPutSignal*>(tp->tp_alloc(tp, 0));
  if (self == nullptr) return nullptr;
  self->vectorcall = put_signal_call;
  self->dst = PyLong_AsUnsignedLongLong(a[0]);
  self->src = PyLong_AsUnsignedLongLong(a[1]);
  self->nbytes = PyLong_AsUnsignedLongLong(a[2]);
  self->sig = PyLong_AsUnsignedLongLong(a[3]);
  self->op = static_cast<int>(PyLong_AsLong(a[4]));
  self->owner = reinterpret_cast<Ctrl*>(PyLong_AsUnsignedLongLong(a[5]));
  self->group = reinterpret_cast<const Group*>(PyLong_AsUnsignedLongLong(a[6]));
  Py_INCREF(a[7]);
  self->keep = a[7];
  if (PyErr_Occurred() || (self->nbytes && !check_mapped("prepare_put_signal", "destination", self->dst, self->nbytes)) ||
      !check_mapped("prepare_put_signal", "signal word", self->sig, 8) ||
      !check_mapped("prepare_put_signal", "control block", reinterpret_cast<uintptr_t>(self->owner), sizeof(Ctrl)) ||
      !check_group("prepare_put_signal", reinterpret_cast<uintptr_t>(self->group))) {
    Py_DECREF(self);
    return nullptr;
  }
  return reinterpret_cast<PyObject*>(self);
}

// make_wait(addr, cmp, owner_ctrl, timeout_s, group, dep, keep, what, mask)
PyObject* make_wait(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (n != 9) {
    PyErr_SetString(PyExc_TypeError, "_C.make_wait: expected 9 arguments");
    return nullptr;
  }
  if (a[8] != Py_None && !PyBytes_Check(a[8])) {
    PyErr_SetString(PyExc_TypeError, "_C.make_wait: mask must be bytes or None");
    return nullptr;
  }
  auto* tp = reinterpret_cast<PyTypeObject*>(g_wait_type);
  auto* self = reinterpret_cast<PreparedWait*>(tp->tp_alloc(tp, 0));
  if (self == nullptr) return nullptr;
  self->vectorcall = wait_call;
  self->addr = PyLong_AsUnsignedLongLong(a[0]);
  self->cmp = static_cast<int>(PyLong_AsLong(a[1]));
  self->owner = reinterpret_cast<Ctrl*>(PyLong_AsUnsignedLongLong(a[2]));
  self->timeout = PyFloat_AsDouble(a[3]);
  self->group = reinterpret_cast<const Group*>(PyLong_AsUnsignedLongLong(a[4]));
  self->dep = static_cast<int>(PyLong_AsLong(a[5]));
  Py_INCREF(a[6]);
  self->keep = a[6];
  Py_INCREF(a[7]);
  self->what = a[7];
  if (a[8] != Py_None) {
    Py_INCREF(a[8]);
    self->mask = a[8];
  }
  if (PyErr_Occurred() || !check_mapped("prepare_signal_wait", "signal word", self->addr, 8) ||
      !check_mapped("prepare_signal_wait", "control block", reinterpret_cast<uintptr_t>(self->owner), sizeof(Ctrl)) ||
      !check_group("prepare_signal_wait", reinterpret_cast<uintptr_t>(self->group))) {
    Py_DECREF(self);
    return nullptr;
  }
  if ((self->dep == kDepSet && self->mask == nullptr) ||
      (self->mask != nullptr && PyBytes_GET_SIZE(self->mask) != self->group->world_size())) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "_C.make_wait: inconsistent dep/mask");
    Py_DECREF(self);
    return nullptr;
  }
  return reinterpret_cast<PyObject*>(self);
}

}  // namespace asap
