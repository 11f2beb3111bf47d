// Python types for mailboxes: _C.Inbox (the base class of asap_comm.Mailbox)
// and _C.Message. The per-message path (send, recv, poll, release) runs here
// without Python bytecode; anything irregular (wrong types, non-contiguous or
// non-CPU tensors, keyword arguments, values out of range) is handed to the
// Python subclass's _send_checked, which validates and raises the documented
// errors, so error messages live in one place.
#include <Python.h>
#include <structmember.h>

#include <cmath>
#include <string>
#include <vector>

#include "asap_shm.hpp"
#include "handles.hpp"

namespace asap {

namespace {

std::vector<PyObject*> g_dtypes;            // wire code -> torch.dtype
std::vector<uint64_t> g_itemsize;           // wire code -> bytes
PyObject *s_dtype, *s_is_cpu, *s_is_contiguous, *s_shape, *s_data_ptr, *s_send_checked, *s_make_view;
PyObject* g_message_type = nullptr;
PyObject* g_prepared_send_type = nullptr;

struct Inbox {
  PyObject_HEAD
  uintptr_t base;
  size_t nslots, slot_bytes;
  uint32_t world, rank;
  const Group* group;
  double timeout;
  std::vector<uintptr_t>* remote;  // per PE: address of that PE's inbox in this process
  std::vector<Ctrl*>* ctrl;        // per PE: control block
  PyObject* keep;                  // Group object and mappings
  // per-slot cache of the tensor view of the last message in that slot
  std::vector<PyObject*>* view;
  std::vector<PyObject*>* view_shape;
  std::vector<uint32_t>* view_dtype;
};

struct Message {
  PyObject_HEAD
  PyObject* src;
  PyObject* tag;
  PyObject* tensor;
  Inbox* box;  // NULL once released
  uint64_t pos;
};

PyObject* closed_error(const char* fn) { return raise_closed(fn); }

// ------------------------------------------------------------------ Message
void release_message(Message* m) {
  Inbox* box = m->box;
  if (box == nullptr) return;
  if (!box->group->closed()) ring_release(box->base, box->nslots, box->slot_bytes, m->pos, (*box->ctrl)[box->rank]);
  m->box = nullptr;
  Py_DECREF(reinterpret_cast<PyObject*>(box));
  Py_CLEAR(m->tensor);
}

PyObject* message_release(PyObject* self, PyObject*) {
  release_message(reinterpret_cast<Message*>(self));
  Py_RETURN_NONE;
}
PyObject* message_enter(PyObject* self, PyObject*) {
  Py_INCREF(self);
  return self;
}
PyObject* message_exit(PyObject* self, PyObject* const*, Py_ssize_t) {
  release_message(reinterpret_cast<Message*>(self));
  Py_RETURN_FALSE;
}
PyObject* message_released(PyObject* self, void*) {
  return PyBool_FromLong(reinterpret_cast<Message*>(self)->box == nullptr);
}
PyObject* message_repr(PyObject* self) {
  auto* m = reinterpret_cast<Message*>(self);
  if (m->tensor == nullptr) return PyUnicode_FromFormat("Message(src=%S, tag=%S, released)", m->src, m->tag);
  PyObject* dt = PyObject_GetAttr(m->tensor, s_dtype);
  PyObject* sh = PyObject_GetAttr(m->tensor, s_shape);
  PyObject* r = (dt && sh) ? PyUnicode_FromFormat("Message(src=%S, tag=%S, dtype=%S, shape=%S)", m->src, m->tag, dt, sh)
                           : nullptr;
  Py_XDECREF(dt);
  Py_XDECREF(sh);
  return r;
}
void message_dealloc(PyObject* self) {
  auto* m = reinterpret_cast<Message*>(self);
  PyTypeObject* tp = Py_TYPE(self);
  // A message dropped without release() keeps its slot until the consumer
  // releases it; the garbage collector releasing it silently would hide a
  // bug, but leaking the slot forever would wedge producers. Release it.
  release_message(m);
  Py_XDECREF(m->src);
  Py_XDECREF(m->tag);
  tp->tp_free(self);
  Py_DECREF(tp);
}

PyMethodDef message_methods[] = {
    {"release", message_release, METH_NOARGS, "Give the slot back to producers (idempotent)."},
    {"__enter__", message_enter, METH_NOARGS, nullptr},
    {"__exit__", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(message_exit)), METH_FASTCALL, nullptr},
    {nullptr, nullptr, 0, nullptr}};
PyMemberDef message_members[] = {
    {"src", T_OBJECT, offsetof(Message, src), READONLY, "sending PE (int)"},
    {"tag", T_OBJECT, offsetof(Message, tag), READONLY, "tag given to send (int)"},
    {"tensor", T_OBJECT, offsetof(Message, tensor), READONLY,
     "zero-copy view into the inbox slot (same dtype and shape as sent); None once released"},
    {nullptr, 0, 0, 0, nullptr}};
PyGetSetDef message_getset[] = {{"released", message_released, nullptr, "True once release() ran", nullptr},
                                {nullptr, nullptr, nullptr, nullptr, nullptr}};
PyType_Slot message_slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(message_dealloc)},
    {Py_tp_methods, message_methods},
    {Py_tp_members, message_members},
    {Py_tp_getset, message_getset},
    {Py_tp_repr, reinterpret_cast<void*>(message_repr)},
    {Py_tp_doc, const_cast<char*>(
                    "A received message: src, tag, tensor (a zero-copy view into the inbox, valid until "
                    "release()). Use as a context manager or call release(); until then the slot is not reused.")},
    {0, nullptr}};
PyType_Spec message_spec = {"asap_comm.Message", sizeof(Message), 0, Py_TPFLAGS_DEFAULT, message_slots};

// One mailbox message to PE `pe`: straight into its ring when it shares this
// host, through the network engine when it does not.
WaitResult deliver(Inbox* b, int pe, int64_t tag, uint32_t code, int ndim, const int64_t* dims, const void* payload,
                   size_t nbytes, double timeout) {
  if (b->group->is_remote(pe)) {
    NetIface* net = b->group->net();
    if (net == nullptr) return {kWaitPeer, 0, pe, "is on another host and the network engine is closed"};
    return net->mbox_send(pe, b->base, b->nslots, b->slot_bytes, tag, code, ndim, dims, payload, nbytes, timeout);
  }
  return ring_send((*b->remote)[pe], b->nslots, b->slot_bytes, (*b->ctrl)[pe], b->rank, tag, code, ndim, dims, payload,
                   nbytes, timeout, b->group, pe);
}

// ------------------------------------------------------------------ Inbox
int inbox_init(PyObject* self_, PyObject* args, PyObject*) {
  auto* self = reinterpret_cast<Inbox*>(self_);
  unsigned long long base, group;
  PyObject *remote, *ctrl, *keep;
  Py_ssize_t nslots, slot_bytes;
  unsigned int world, rank;
  double timeout;
  if (!PyArg_ParseTuple(args, "KOOnnIIKdO", &base, &remote, &ctrl, &nslots, &slot_bytes, &world, &rank, &group,
                        &timeout, &keep))
    return -1;
  if (!PyList_Check(remote) || !PyList_Check(ctrl) || PyList_GET_SIZE(remote) != world ||
      PyList_GET_SIZE(ctrl) != world || nslots <= 0 || slot_bytes <= 0 || rank >= world) {
    PyErr_SetString(PyExc_ValueError, "Inbox: inconsistent geometry");
    return -1;
  }
  const size_t span = mailbox_bytes(static_cast<size_t>(slot_bytes), static_cast<size_t>(nslots));
  if (!check_group("Inbox", group) || !check_mapped("Inbox", "inbox", base, span)) return -1;
  for (unsigned i = 0; i < world; ++i) {  // 0: a PE on another host (reached through the network engine)
    const uintptr_t r = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(remote, i));
    const uintptr_t c = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(ctrl, i));
    if (PyErr_Occurred()) return -1;
    if ((r != 0 || i == rank) && !check_mapped("Inbox", "peer inbox", r, span)) return -1;
    if ((c != 0 || i == rank) && !check_mapped("Inbox", "peer control block", c, sizeof(Ctrl))) return -1;
  }
  self->base = base;
  self->nslots = static_cast<size_t>(nslots);
  self->slot_bytes = static_cast<size_t>(slot_bytes);
  self->world = world;
  self->rank = rank;
  self->group = reinterpret_cast<const Group*>(group);
  self->timeout = timeout;
  self->remote = new std::vector<uintptr_t>(world);
  self->ctrl = new std::vector<Ctrl*>(world);
  for (unsigned i = 0; i < world; ++i) {
    (*self->remote)[i] = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(remote, i));
    (*self->ctrl)[i] = reinterpret_cast<Ctrl*>(PyLong_AsUnsignedLongLong(PyList_GET_ITEM(ctrl, i)));
  }
  if (PyErr_Occurred()) return -1;
  self->view = new std::vector<PyObject*>(self->nslots, nullptr);
  self->view_shape = new std::vector<PyObject*>(self->nslots, nullptr);
  self->view_dtype = new std::vector<uint32_t>(self->nslots, 0);
  Py_INCREF(keep);
  Py_XSETREF(self->keep, keep);
  return 0;
}

void inbox_clear_views(Inbox* self) {
  if (self->view == nullptr) return;
  for (auto& p : *self->view) Py_CLEAR(p);
  for (auto& p : *self->view_shape) Py_CLEAR(p);
}

void inbox_dealloc(PyObject* self_) {
  auto* self = reinterpret_cast<Inbox*>(self_);
  PyTypeObject* tp = Py_TYPE(self_);
  inbox_clear_views(self);
  delete self->view;
  delete self->view_shape;
  delete self->view_dtype;
  delete self->remote;
  delete self->ctrl;
  Py_CLEAR(self->keep);
  tp->tp_free(self_);
  Py_DECREF(tp);
}

PyObject* call_slow(PyObject* self, PyObject* name, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  // self._send_checked(*args, **kw) with the caller's exact arguments.
  const Py_ssize_t n = PyVectorcall_NARGS(nargsf);
  const Py_ssize_t nk = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  std::vector<PyObject*> stack(static_cast<size_t>(1 + n + nk));
  stack[0] = self;
  for (Py_ssize_t i = 0; i < n + nk; ++i) stack[static_cast<size_t>(1 + i)] = args[i];
  return PyObject_VectorcallMethod(name, stack.data(), static_cast<size_t>(1 + n), kwnames);
}

bool exact_int(PyObject* o) { return PyLong_CheckExact(o); }

// What a send reads from the tensor it sends: all of it from the tensor object.
struct SendFacts {
  uintptr_t ptr;
  size_t nbytes;
  uint32_t code;
  int ndim;
  int64_t dims[kMaxDims];
};

// The one reader of a message's tensor facts (send, the validated send, prepare_send). 1: `t` is a contiguous
// CPU torch.Tensor of a mailbox dtype with at most kMaxDims dimensions that fits a slot; 0: it is not (nothing
// set: the caller's validating path says why); -1: a Python error is set.
int send_facts(Inbox* self, PyObject* t, SendFacts* f) {
  if (!PyObject_TypeCheck(t, reinterpret_cast<PyTypeObject*>(tensor_type()))) return 0;
  PyObject* dt = PyObject_GetAttr(t, s_dtype);
  if (dt == nullptr) return -1;
  uint32_t code = 0;
  while (code < g_dtypes.size() && g_dtypes[code] != dt) ++code;
  Py_DECREF(dt);
  if (code == g_dtypes.size()) return 0;
  PyObject* cpu = PyObject_GetAttr(t, s_is_cpu);
  if (cpu == nullptr) return -1;
  Py_DECREF(cpu);
  if (cpu != Py_True) return 0;
  PyObject* contig = PyObject_CallMethodNoArgs(t, s_is_contiguous);
  if (contig == nullptr) return -1;
  Py_DECREF(contig);
  if (contig != Py_True) return 0;
  PyObject* shape = PyObject_GetAttr(t, s_shape);
  if (shape == nullptr) return -1;
  const Py_ssize_t ndim = PyTuple_Check(shape) ? PyTuple_GET_SIZE(shape) : kMaxDims + 1;
  if (ndim > kMaxDims) {
    Py_DECREF(shape);
    return 0;
  }
  unsigned __int128 nbytes = g_itemsize[code];
  for (Py_ssize_t i = 0; i < ndim; ++i) {
    f->dims[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
    nbytes *= static_cast<uint64_t>(f->dims[i]);
    if (nbytes > self->slot_bytes) nbytes = static_cast<unsigned __int128>(self->slot_bytes) + 1;
  }
  Py_DECREF(shape);
  if (PyErr_Occurred()) return -1;
  if (nbytes > self->slot_bytes) return 0;
  PyObject* ptr_o = PyObject_CallMethodNoArgs(t, s_data_ptr);
  if (ptr_o == nullptr) return -1;
  f->ptr = PyLong_AsUnsignedLong(ptr_o);  // (digits read directly: see handles_py.cpp, exact_u64)
  Py_DECREF(ptr_o);
  if (PyErr_Occurred()) return -1;
  f->nbytes = static_cast<size_t>(nbytes);
  f->code = code;
  f->ndim = static_cast<int>(ndim);
  return 1;
}

// The one native send: every form of send ends here.
PyObject* send_message(Inbox* b, int pe, const SendFacts& f, int64_t tag, double timeout) {
  if (b->group->closed()) return closed_error("send");
  WaitResult r = deliver(b, pe, tag, f.code, f.ndim, f.dims, reinterpret_cast<const void*>(f.ptr), f.nbytes, timeout);
  if (r.status == kWaitOk) Py_RETURN_NONE;
  PyObject* what = r.status == kWaitTimeout && r.why == kUnanswered
                       ? PyUnicode_FromFormat("send: PE %d (on another host) did not answer: its process lives but "
                                              "does not run (stopped?); the message may still be placed, and "
                                              "offering the same message again awaits that same answer", pe)
                       : PyUnicode_FromFormat("send: waiting for a free slot in PE %d's inbox", pe);
  raise_wait_error(r, timeout, what);
  Py_XDECREF(what);
  return nullptr;
}

PyObject* inbox_send(PyObject* self_, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  auto* self = reinterpret_cast<Inbox*>(self_);
  auto slow = [&] { return call_slow(self_, s_send_checked, args, static_cast<size_t>(nargs), kwnames); };
  if (kwnames != nullptr || nargs < 2 || nargs > 3 || self->group->closed()) return slow();
  PyObject* pe_o = args[0];
  if (!exact_int(pe_o)) return slow();
  int overflow = 0;
  const long long pe = PyLong_AsLongLongAndOverflow(pe_o, &overflow);
  if (overflow || pe < 0 || pe >= self->world) return slow();
  long long tag = 0;
  if (nargs == 3) {
    if (!exact_int(args[2])) return slow();
    tag = PyLong_AsLongLongAndOverflow(args[2], &overflow);
    if (overflow) return slow();
  }
  if (Py_TYPE(args[1]) != reinterpret_cast<PyTypeObject*>(tensor_type())) return slow();
  SendFacts f;
  const int ok = send_facts(self, args[1], &f);
  if (ok < 0) return nullptr;
  if (ok == 0) return slow();
  return send_message(self, static_cast<int>(pe), f, tag, self->timeout);
}

PyObject* make_message(Inbox* self, const RecvResult& r) {
  if (r.error[0]) {
    PyErr_Format(comm_error_type(), "mailbox: corrupt message header at position %llu: %s",
                 static_cast<unsigned long long>(r.pos), r.error);
    return nullptr;
  }
  const size_t slot = r.pos % self->nslots;
  PyObject* tensor = (*self->view)[slot];
  bool hit = false;
  if (tensor != nullptr && (*self->view_dtype)[slot] == r.dtype) {
    PyObject* cached = (*self->view_shape)[slot];
    if (PyTuple_GET_SIZE(cached) == static_cast<Py_ssize_t>(r.ndim)) {
      hit = true;
      for (uint32_t i = 0; i < r.ndim && hit; ++i)
        hit = PyLong_AsLongLong(PyTuple_GET_ITEM(cached, i)) == r.dims[i];
    }
  }
  if (hit) {
    Py_INCREF(tensor);
  } else {
    PyObject* shape = PyTuple_New(r.ndim);
    if (shape == nullptr) return nullptr;
    for (uint32_t i = 0; i < r.ndim; ++i) PyTuple_SET_ITEM(shape, i, PyLong_FromLongLong(r.dims[i]));
    tensor = PyObject_CallMethod(reinterpret_cast<PyObject*>(self), "_make_view", "nIOK", static_cast<Py_ssize_t>(slot),
                                 r.dtype, shape, static_cast<unsigned long long>(r.nbytes));
    if (tensor == nullptr) {
      Py_DECREF(shape);
      ring_release(self->base, self->nslots, self->slot_bytes, r.pos, (*self->ctrl)[self->rank]);
      return nullptr;
    }
    Py_XSETREF((*self->view)[slot], tensor);
    Py_INCREF(tensor);
    Py_XSETREF((*self->view_shape)[slot], shape);
    (*self->view_dtype)[slot] = r.dtype;
  }
  auto* tp = reinterpret_cast<PyTypeObject*>(g_message_type);
  auto* m = reinterpret_cast<Message*>(tp->tp_alloc(tp, 0));
  if (m == nullptr) {
    Py_DECREF(tensor);
    return nullptr;
  }
  m->src = PyLong_FromUnsignedLong(r.src);
  m->tag = PyLong_FromLongLong(r.tag);
  m->tensor = tensor;
  m->pos = r.pos;
  Py_INCREF(self);
  m->box = self;
  return reinterpret_cast<PyObject*>(m);
}

// The error of a recv/poll that returned no message.
PyObject* recv_error(Inbox* self, const char* fn, const RecvResult& r, double timeout) {
  PyObject* what;
  if (r.wait.status == kWaitAbandoned) {
    what = PyUnicode_FromFormat(
        "%s: the message at position %llu of PE %u's inbox was dropped half-written (the messages behind it are "
        "unaffected)",
        fn, static_cast<unsigned long long>(r.pos), self->rank);
  } else {
    what = PyUnicode_FromFormat("%s: waiting for a message in PE %u's inbox (position %llu, %zu slots)", fn,
                                self->rank, static_cast<unsigned long long>(r.pos), self->nslots);
  }
  raise_wait_error(r.wait, timeout, what, false);
  Py_XDECREF(what);
  return nullptr;
}

PyObject* inbox_recv(PyObject* self_, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  auto* self = reinterpret_cast<Inbox*>(self_);
  PyObject* t_o = nullptr;
  const Py_ssize_t nk = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  if (nargs > 1 || nargs + nk > 1) {
    PyErr_SetString(PyExc_TypeError, "recv: takes at most one argument (timeout)");
    return nullptr;
  }
  if (nargs == 1) t_o = args[0];
  if (nk == 1) {
    if (PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "timeout") != 0) {
      PyErr_Format(PyExc_TypeError, "recv: unexpected keyword argument %R", PyTuple_GET_ITEM(kwnames, 0));
      return nullptr;
    }
    t_o = args[0];
  }
  if (self->group->closed()) return closed_error("recv");
  double timeout = self->timeout;
  if (t_o != nullptr && t_o != Py_None) {
    if (PyBool_Check(t_o) || !(PyFloat_Check(t_o) || PyLong_Check(t_o))) {
      PyErr_Format(PyExc_TypeError, "recv: timeout must be a number of seconds or None, got %R", t_o);
      return nullptr;
    }
    timeout = PyFloat_AsDouble(t_o);
    if (PyErr_Occurred()) return nullptr;
    if (!(timeout >= 0) || std::isinf(timeout)) {
      PyErr_Format(PyExc_ValueError, "recv: timeout must be finite and >= 0, got %R", t_o);
      return nullptr;
    }
  }
  RecvResult r = ring_recv(self->base, self->nslots, self->slot_bytes, self->world, (*self->ctrl)[self->rank], timeout,
                           self->group, g_itemsize.data(), static_cast<uint32_t>(g_itemsize.size()));
  if (r.wait.status != kWaitOk) return recv_error(self, "recv", r, timeout);
  return make_message(self, r);
}

PyObject* inbox_poll(PyObject* self_, PyObject*) {
  auto* self = reinterpret_cast<Inbox*>(self_);
  if (self->group->closed()) return closed_error("poll");
  RecvResult r = ring_recv(self->base, self->nslots, self->slot_bytes, self->world, (*self->ctrl)[self->rank], -1.0,
                           self->group, g_itemsize.data(), static_cast<uint32_t>(g_itemsize.size()));
  if (r.empty) Py_RETURN_NONE;
  if (r.wait.status != kWaitOk) return recv_error(self, "poll", r, 0.0);
  return make_message(self, r);
}

// (pe, tensor, tag) that Mailbox's validating path has checked: the PE and tag, and the tensor's facts.
bool validated_send(Inbox* self, const char* fn, PyObject* const* a, long long* pe, long long* tag, SendFacts* f) {
  *pe = PyLong_AsLongLong(a[0]);
  *tag = PyLong_AsLongLong(a[2]);
  if (PyErr_Occurred()) return false;
  const int ok = *pe >= 0 && *pe < self->world ? send_facts(self, a[1], f) : 0;
  if (ok == 0)
    PyErr_Format(PyExc_ValueError, "%s: pe=%lld or the tensor is not sendable as validated", fn, *pe);
  return ok > 0;
}

// _ring_send(pe, tensor, tag, timeout): the send of the validating path (Mailbox._send_checked), which has
// checked the arguments and made the tensor contiguous.
PyObject* inbox_ring_send(PyObject* self_, PyObject* const* a, Py_ssize_t n) {
  auto* self = reinterpret_cast<Inbox*>(self_);
  if (n != 4) {
    PyErr_SetString(PyExc_TypeError, "_ring_send(pe, tensor, tag, timeout)");
    return nullptr;
  }
  const double timeout = PyFloat_AsDouble(a[3]);
  long long pe, tag;
  SendFacts f;
  if ((timeout == -1.0 && PyErr_Occurred()) || !validated_send(self, "send", a, &pe, &tag, &f)) return nullptr;
  return send_message(self, static_cast<int>(pe), f, tag, timeout);
}

// ------------------------------------------------------------------ PreparedSend
// box.prepare_send(pe, tensor, tag): a send whose tensor facts were read and
// checked once; calling it copies the tensor's current bytes as a message.
struct PreparedSend {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  Inbox* box;
  int pe;
  SendFacts facts;
  int64_t tag;
  PyObject* keep;  // the tensor
};

PyObject* prepared_send_call(PyObject* self_, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* self = reinterpret_cast<PreparedSend*>(self_);
  const Py_ssize_t n = PyVectorcall_NARGS(nargsf);
  int64_t tag = self->tag;
  const Py_ssize_t nk = kwnames != nullptr ? PyTuple_GET_SIZE(kwnames) : 0;
  if (n + nk > 1) {
    PyErr_Format(PyExc_TypeError, "send: a prepared handle takes at most one argument, tag (%zd given)", n + nk);
    return nullptr;
  }
  if (nk == 1 && PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "tag") != 0) {
    PyErr_Format(PyExc_TypeError, "send: unexpected keyword argument %R for a prepared handle (its one argument is tag)",
                 PyTuple_GET_ITEM(kwnames, 0));
    return nullptr;
  }
  if (n + nk == 1) {
    if (!PyLong_Check(args[0]) || PyBool_Check(args[0])) {
      PyErr_Format(PyExc_TypeError, "send: tag must be an int, got %s", Py_TYPE(args[0])->tp_name);
      return nullptr;
    }
    int overflow = 0;
    tag = PyLong_AsLongLongAndOverflow(args[0], &overflow);
    if (overflow) {
      PyErr_Format(PyExc_ValueError, "send: tag=%R does not fit a signed 64-bit int", args[0]);
      return nullptr;
    }
  }
  return send_message(self->box, self->pe, self->facts, tag, self->box->timeout);
}

void prepared_send_dealloc(PyObject* self_) {
  auto* self = reinterpret_cast<PreparedSend*>(self_);
  PyTypeObject* tp = Py_TYPE(self_);
  Py_XDECREF(reinterpret_cast<PyObject*>(self->box));
  Py_XDECREF(self->keep);
  tp->tp_free(self_);
  Py_DECREF(tp);
}

PyMemberDef prepared_send_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(PreparedSend, vectorcall), READONLY, nullptr},
    {nullptr, 0, 0, 0, nullptr}};
PyType_Slot prepared_send_slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(prepared_send_dealloc)},
    {Py_tp_call, reinterpret_cast<void*>(PyVectorcall_Call)},
    {Py_tp_members, prepared_send_members},
    {Py_tp_doc, const_cast<char*>("A send prepared by Mailbox.prepare_send: call it (optionally with a tag) to send "
                                  "the tensor's current contents.")},
    {0, nullptr}};
#ifndef Py_TPFLAGS_HAVE_VECTORCALL
#define Py_TPFLAGS_HAVE_VECTORCALL _Py_TPFLAGS_HAVE_VECTORCALL
#endif
PyType_Spec prepared_send_spec = {"asap_comm._C.PreparedSend", sizeof(PreparedSend), 0,
                                  Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL, prepared_send_slots};

// _make_prepared_send(pe, tensor, tag): validated by Python (Mailbox.prepare_send); the tensor's facts are read
// from it here, once.
PyObject* inbox_make_prepared_send(PyObject* self_, PyObject* const* a, Py_ssize_t n) {
  auto* self = reinterpret_cast<Inbox*>(self_);
  if (n != 3) {
    PyErr_SetString(PyExc_TypeError, "_make_prepared_send(pe, tensor, tag)");
    return nullptr;
  }
  long long pe, tag;
  SendFacts f;
  if (!validated_send(self, "prepare_send", a, &pe, &tag, &f)) return nullptr;
  auto* tp = reinterpret_cast<PyTypeObject*>(g_prepared_send_type);
  auto* h = reinterpret_cast<PreparedSend*>(tp->tp_alloc(tp, 0));
  if (h == nullptr) return nullptr;
  h->vectorcall = prepared_send_call;
  h->pe = static_cast<int>(pe);
  h->facts = f;
  h->tag = tag;
  Py_INCREF(self_);
  h->box = self;
  Py_INCREF(a[1]);
  h->keep = a[1];
  return reinterpret_cast<PyObject*>(h);
}

PyMethodDef inbox_methods[] = {
    {"send", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(inbox_send)), METH_FASTCALL | METH_KEYWORDS,
     "send(pe, tensor, tag=0, timeout=None)\n--\n\nCopy `tensor` into PE `pe`'s inbox as one message (see Mailbox)."},
    {"recv", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(inbox_recv)), METH_FASTCALL | METH_KEYWORDS,
     "recv(timeout=None)\n--\n\nWait (bounded) for the next message of this PE's inbox (see Mailbox)."},
    {"poll", inbox_poll, METH_NOARGS, "poll()\n--\n\nThe next message if one is ready, else None; never waits."},
    {"_make_prepared_send", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(inbox_make_prepared_send)),
     METH_FASTCALL, nullptr},
    {"_ring_send", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(inbox_ring_send)), METH_FASTCALL,
     nullptr},
    {nullptr, nullptr, 0, nullptr}};
PyMemberDef inbox_members[] = {
    {"slot_bytes", T_PYSSIZET, offsetof(Inbox, slot_bytes), READONLY, "largest payload of one message, bytes"},
    {"num_slots", T_PYSSIZET, offsetof(Inbox, nslots), READONLY, "messages an inbox holds before senders wait"},
    {nullptr, 0, 0, 0, nullptr}};
PyType_Slot inbox_slots[] = {{Py_tp_dealloc, reinterpret_cast<void*>(inbox_dealloc)},
                             {Py_tp_init, reinterpret_cast<void*>(inbox_init)},
                             {Py_tp_new, reinterpret_cast<void*>(PyType_GenericNew)},
                             {Py_tp_methods, inbox_methods},
                             {Py_tp_members, inbox_members},
                             {0, nullptr}};
PyType_Spec inbox_spec = {"asap_comm._C.Inbox", sizeof(Inbox), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
                          inbox_slots};

PyObject* set_tensor_info(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (n != 3 || !PyList_Check(a[1]) || !PyList_Check(a[2]) || PyList_GET_SIZE(a[1]) != PyList_GET_SIZE(a[2])) {
    PyErr_SetString(PyExc_TypeError, "_set_tensor_info(tensor_type, dtypes, itemsizes)");
    return nullptr;
  }
  set_tensor_type(a[0]);
  g_dtypes.clear();
  g_itemsize.clear();
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(a[1]); ++i) {
    PyObject* d = PyList_GET_ITEM(a[1], i);
    Py_INCREF(d);  // dtypes are immortal singletons in torch; keep them anyway
    g_dtypes.push_back(d);
    g_itemsize.push_back(PyLong_AsUnsignedLongLong(PyList_GET_ITEM(a[2], i)));
  }
  if (PyErr_Occurred()) return nullptr;
  Py_RETURN_NONE;
}

PyMethodDef module_methods[] = {
    {"_set_tensor_info", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(set_tensor_info)),
     METH_FASTCALL, "Register torch.Tensor and the mailbox dtype table."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

bool register_inbox_types(PyObject* module) {
  s_dtype = PyUnicode_InternFromString("dtype");
  s_is_cpu = PyUnicode_InternFromString("is_cpu");
  s_is_contiguous = PyUnicode_InternFromString("is_contiguous");
  s_shape = PyUnicode_InternFromString("shape");
  s_data_ptr = PyUnicode_InternFromString("data_ptr");
  s_send_checked = PyUnicode_InternFromString("_send_checked");
  s_make_view = PyUnicode_InternFromString("_make_view");
  g_message_type = PyType_FromSpec(&message_spec);
  g_prepared_send_type = PyType_FromSpec(&prepared_send_spec);
  if (g_prepared_send_type == nullptr) return false;
  Py_INCREF(g_prepared_send_type);
  if (PyModule_AddObject(module, "PreparedSend", g_prepared_send_type) != 0) return false;
  PyObject* inbox = PyType_FromSpec(&inbox_spec);
  if (g_message_type == nullptr || inbox == nullptr) return false;
  Py_INCREF(g_message_type);
  if (PyModule_AddObject(module, "Message", g_message_type) != 0) return false;
  if (PyModule_AddObject(module, "Inbox", inbox) != 0) return false;
  return PyModule_AddFunctions(module, module_methods) == 0;
}

}  // namespace asap
