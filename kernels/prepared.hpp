// Prepared operations and the error helpers they share with bindings.cpp.
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

bool register_prepared_types(PyObject* module);
bool register_inbox_types(PyObject* module);  // inbox_py.cpp
bool register_fastpath_type(PyObject* module);  // fastpath_py.cpp
PyObject* make_put_signal(PyObject*, PyObject* const* a, Py_ssize_t n);
PyObject* make_wait(PyObject*, PyObject* const* a, Py_ssize_t n);

}  // namespace asap
