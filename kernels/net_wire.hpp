// The wire format of the network engine: one UCX active message per operation,
// a fixed header (Hdr) and the payload. Nothing on the wire is an address: a
// message names a region (0 = the control block, 1 + i = heap chunk i) and an
// offset (kernels/net_engine.hpp, "Rules").
#pragma once
#include <cstddef>
#include <cstdint>

#include "asap_shm.hpp"

namespace asap::net {

constexpr unsigned kAmId = 0xA5A;
enum Kind : uint32_t {
  kPut = 1,
  kPutSignal = 2,
  kSignal = 3,       // no reply
  kSignalFetch = 4,  // reply carries the previous value
  kGet = 5,          // reply carries the bytes
  kMbox = 6,         // reply: delivered / full / bad
  kQuiet = 7,        // reply once everything before it is applied
  kHeartbeat = 8,
  kClose = 9,
  kReply = 10,
  kHello = 11,     // set-up: a challenge (32 random bytes) for the receiver to answer
  kHelloAck = 12,  // set-up: the answer (a 32-byte HMAC computed in Python with the group secret)
};
constexpr size_t kHandshakeBytes = 32;
constexpr size_t kByeBytes = 9;  // on a liveness line: 'B', then the last barrier round completed (uint64)
enum ReplyStatus : int32_t { kReplyOk = 0, kReplyFull = 1, kReplyBad = 2 };

struct Hdr {
  uint32_t kind, src;
  uint64_t seq;
  uint32_t region, sig_region;
  uint64_t off, nbytes, sig_off, value;
  uint32_t op, token;
  int32_t status;
  uint32_t ndim;
  int64_t tag;
  uint32_t dtype, pad;
  uint64_t nslots, slot_bytes;
  int64_t dims[kMaxDims];
};

inline const char* kind_name(uint32_t k) {
  switch (k) {
    case kPut: return "put";
    case kPutSignal: return "put_signal";
    case kSignal:
    case kSignalFetch: return "signal_op";
    case kGet: return "get";
    case kMbox: return "mailbox send";
    case kQuiet: return "quiet";
    default: return "message";
  }
}

}  // namespace asap::net
