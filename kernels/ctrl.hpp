// The control block's layout, named by word (kernels/asap_shm.hpp defines Ctrl).
//
// Each PE's control segment is kCtrlBytes: the Ctrl struct, then from
// kCtrlCollOffset two collective-call records of kCtrlCollSlotBytes each
// ([int64 call number][int64 length][description], written by Python). Python
// names a word (_C.CTRL_ARRIVE, ...) and asks for its address (_C.ctrl_addr)
// or span (_C.ctrl_span); the network engine takes the same word ids
// (signal_ctrl, get_ctrl). Offsets never leave native code.
#pragma once
#include <cstddef>
#include <cstdint>

#include "asap_shm.hpp"

namespace asap {

constexpr size_t kCtrlBytes = 4096;
constexpr size_t kCtrlCollOffset = 2048;
constexpr size_t kCtrlCollSlotBytes = 512;
static_assert(sizeof(Ctrl) <= kCtrlCollOffset, "the control block overlaps the collective-call records");
static_assert(kCtrlCollOffset + 2 * kCtrlCollSlotBytes <= kCtrlBytes, "the records overflow the control segment");

// Word ids (exported as _C.CTRL_*): small ints, stable across PEs of one build.
enum CtrlWord : int {
  kCtrlArrive = 0,   // barrier arrivals (an atomic add per PE and round)
  kCtrlGen = 1,      // barrier generation (the last round released)
  kCtrlDone = 2,     // the last barrier round this PE completed
  kCtrlRecords = 3,  // both collective-call records
};

struct CtrlSpan {
  uint64_t off, nbytes;
};

// The span of `word` inside the control segment; false for an unknown word.
inline bool ctrl_span(int64_t word, CtrlSpan* out) {
  switch (word) {
    case kCtrlArrive: *out = {offsetof(Ctrl, barrier_arrive), 8}; return true;
    case kCtrlGen: *out = {offsetof(Ctrl, barrier_gen), 8}; return true;
    case kCtrlDone: *out = {offsetof(Ctrl, barrier_done), 8}; return true;
    case kCtrlRecords: *out = {kCtrlCollOffset, 2 * kCtrlCollSlotBytes}; return true;
    default: return false;
  }
}

}  // namespace asap
