// The one native form of each per-message primitive, and the helpers every
// Python-facing entry point shares (kernels/handles_py.cpp, kernels/ops_py.cpp).
//
// put_signal and the signal wait each have one native object: a validated,
// persistent handle (_C.PreparedPutSignal, _C.PreparedWait), built by one
// function (_C.make_put_signal, _C.make_wait). Communicator.prepare_* return
// such a handle; the generic Communicator.put_signal / signal_wait_until look
// one up in a small table (_C.FastPath) and run it, and on a miss the Python
// validating path builds one, registers it and runs it. So a call has one
// native implementation and each failure one error text, whatever the form.
#pragma once
#include <Python.h>

#include "asap_shm.hpp"

namespace asap {

// Exception types registered from Python (asap_comm/errors.py).
PyObject* comm_error_type();
// Sets TimeoutError/PeerFailure for a failed wait; `what` (a str or nullptr)
// names what was awaited; show_value adds the last value seen to a timeout
// message (meaningless for a mailbox). Returns nullptr.
PyObject* raise_wait_error(const WaitResult& r, double timeout, PyObject* what, bool show_value = true);
// CommError "<fn>: the communicator is closed" (the text Communicator._check_open raises). Returns nullptr.
PyObject* raise_closed(const char* fn);

// torch.Tensor, registered from Python (asap_comm/mailbox.py); nullptr before.
PyObject* tensor_type();
void set_tensor_type(PyObject* t);

// The user-memory side of a copy: bytes [off, off + n) of CPU tensor `t`,
// counted from t.data_ptr() over the bytes its elements span. The address
// comes from the tensor object itself, never from an int computed in Python;
// a range outside the tensor raises ValueError naming `fn` and `name`.
bool tensor_span(PyObject* t, const char* fn, const char* name, uint64_t off, uint64_t n, uintptr_t* addr);

// A signal value (int, 0 <= v < 2**64) and a timeout (None: `fallback`; else a
// finite int/float >= 0), with Communicator._check_value/_timeout's texts.
bool parse_value(const char* fn, PyObject* v, uint64_t* out);
bool parse_timeout(const char* fn, PyObject* t, double fallback, double* out);

bool register_ops(PyObject* module);            // ops_py.cpp: signal_update, load, store, copy_*, ctrl_*, fence
bool register_handle_types(PyObject* module);   // PreparedPutSignal, PreparedWait, FastPath
bool register_inbox_types(PyObject* module);    // inbox_py.cpp
PyObject* make_put_signal(PyObject*, PyObject* const* a, Py_ssize_t n);
PyObject* make_wait(PyObject*, PyObject* const* a, Py_ssize_t n);

}  // namespace asap
