// The module asap_comm._C and its set-up calls (pybind11): segments, the
// group, the control block, mailbox layout and constants. The per-message
// entry points are CPython functions and types in the *_py.cpp files this
// module registers (docs/native.md, "One binding rule").
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
void bind_sim_async(py::module& m);  // kernels/sim_async.cpp
}

namespace {

template <typename T>
inline std::atomic_ref<T> A(T& x) {
  return std::atomic_ref<T>(x);
}

// The same check as check_mapped, as a C++ exception (ValueError).
void need_mapped(const char* fn, uintptr_t addr, size_t n) {
  if (!mapped_range(addr, n))
    throw py::value_error(std::string(fn) + ": address range is not inside a mapped asap_comm segment");
}

}  // namespace


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

  bind_net(m);
  bind_sim_async(m);
  if (!register_ops(m.ptr())) throw py::error_already_set();  // ops_py.cpp
  if (!register_handle_types(m.ptr())) throw py::error_already_set();  // handles_py.cpp
  if (!register_inbox_types(m.ptr())) throw py::error_already_set();  // inbox_py.cpp
}
