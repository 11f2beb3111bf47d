// asap_comm CPU shared-memory backend: the one interface between the Python
// runtime (kernels/*_py.cpp) and the native code.
//
// Everything here works on raw addresses inside POSIX shared-memory mappings.
// Words that more than one process touches are accessed only through
// std::atomic_ref with explicit memory orders; nothing relies on x86 TSO.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace asap {

// ---------------------------------------------------------------------------
// Segments
// ---------------------------------------------------------------------------

// An owned mmap of a shared-memory object. Unmapped in the destructor, so the
// mapping lives exactly as long as the Python object (and every torch tensor
// created over its buffer) that owns it.
class Mapping {
 public:
  Mapping(void* addr, size_t size, int fd = -1) : addr_(addr), size_(size), fd_(fd) {}
  ~Mapping();
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  uintptr_t addr() const { return reinterpret_cast<uintptr_t>(addr_); }
  size_t size() const { return size_; }
  void* ptr() const { return addr_; }
  // Allocates bytes [offset, offset + n) of a segment this PE created for
  // real (posix_fallocate), so that touching them can never raise SIGBUS on
  // a full /dev/shm. Returns 0 or the errno (ENOSPC: no room); EBADF for a
  // mapping of a peer's segment (its owner allocates it).
  int reserve(size_t offset, size_t n) const;

 private:
  void* addr_;
  size_t size_;
  int fd_;  // the segment's descriptor when this PE created it (kept for reserve), else -1
};

// Every live Mapping registers its address range (created or mapped here,
// dropped in its destructor). Addresses that Python passes to native code
// (symmetric memory, control blocks, mailboxes) are checked against these
// ranges before anything is read or written, so a Python-side bug becomes a
// ValueError, not a stray write: check_mapped sets "<fn>: <what> [a, a+n) is
// not inside a mapped asap_comm segment" and returns false.
bool mapped_range(uintptr_t addr, size_t n);
bool check_mapped(const char* fn, const char* what, uintptr_t addr, size_t n);
// Group handles passed as ints are checked against the live Groups the same way.
bool check_group(const char* fn, uintptr_t handle);

// Creates a new segment (O_EXCL, mode 0600), sizes it and maps it. Throws
// std::runtime_error with errno text on failure; on failure nothing is left.
Mapping* create_segment(const std::string& name, size_t size);
// Maps an existing segment created by a peer; checks that its size matches.
Mapping* map_segment(const std::string& name, size_t size);
// shm_unlink; returns false (no throw) if the name was already gone.
bool unlink_segment(const std::string& name);

// ---------------------------------------------------------------------------
// Per-PE control block (first bytes of each PE's control segment)
// ---------------------------------------------------------------------------

constexpr uint64_t kCtrlMagic = 0x41534150434f4d31ull;  // "ASAPCOM1"
enum PeState : uint32_t { kStateInit = 0, kStateAlive = 1, kStateClosed = 2, kStateDead = 3 };

struct alignas(64) Ctrl {
  uint64_t magic;
  uint32_t pid;
  uint32_t rank;
  uint32_t state;  // PeState, atomic access only
  uint32_t pad0[11];
  // Futex word: bumped by anyone who changes a word in this PE's memory that a
  // sleeper may be waiting for, but only when `sleepers` is non-zero.
  alignas(64) uint32_t futex_seq;
  alignas(64) uint32_t sleepers;
  // Central barrier (used on PE 0 only): cumulative arrivals and generation.
  alignas(64) uint64_t barrier_arrive;
  alignas(64) uint64_t barrier_gen;
  // The last barrier round this PE completed (every PE, atomic access only):
  // a PE that closes after completing round k is not missing from round k,
  // so peers still finishing it do not fail (kDepBarrier).
  alignas(64) uint64_t barrier_done;
  // Where this PE's waiting thread runs: (steady-clock microseconds << 16) |
  // (CPU + 1), written when a wait starts, every few microseconds while it
  // spins and when it wakes; 0 while it sleeps on a futex (and before its
  // first wait). A waiter that finds a recently seen PE of its group on its
  // own CPU sleeps at once instead of spinning: spinning would only keep
  // that PE from running (see wait_until).
  alignas(64) uint64_t run_stamp;
};
static_assert(sizeof(Ctrl) <= 4096, "control block must fit in one page");

// ---------------------------------------------------------------------------
// Group: liveness of the peers
// ---------------------------------------------------------------------------

// Which peers a wait depends on (the `dep` of wait_until).
constexpr int kDepAny = -1;     // any peer may satisfy it: fails if a peer died,
                                // or if every other peer has closed or died
constexpr int kDepAll = -2;     // every peer must act (barrier): fails if any
                                // peer died or closed
constexpr int kDepSet = -3;     // the PEs of a mask may satisfy it: fails only
                                // when every one of them has died or closed
constexpr int kDepOthers = -4;  // any other PE may satisfy it (a mailbox
                                // recv): fails only when every other PE has
                                // died or closed
constexpr int kDepBarrier = -5; // barrier round `round` (the awaited value):
                                // as kDepAll, except that a PE which closed
                                // (or, on this host, died) after completing
                                // that round is not a failure
// dep >= 0: that one PE must act: fails if it died or closed.

enum WaitStatus : int { kWaitOk = 0, kWaitTimeout = 1, kWaitPeer = 2, kWaitInterrupted = 3, kWaitAbandoned = 4 };

struct WaitResult {
  int status;
  uint64_t value;  // last value seen
  int pe;          // failing PE for kWaitPeer
  const char* why;
};

// The network engine as the shared-memory code sees it (kernels/net_engine.hpp):
// waits help it progress while they spin, and a mailbox send to a PE on
// another host goes through it. Null when every PE is on this host.
// WaitResult::why of a mailbox send to another host that timed out waiting for the peer's answer (not for room):
// the message may still be placed (see NetEngine::mbox_send).
inline constexpr const char* kUnanswered = "unanswered";

class NetIface {
 public:
  virtual ~NetIface() = default;
  // Progresses the engine if no other thread is doing so; never blocks.
  virtual void poll() = 0;
  // A thread spins polling the engine between these (a wait's spin phase);
  // meanwhile the engine's own progress thread stays parked instead of
  // waking on every message (on a small host its wake-ups cost more than
  // the message). `sleeping`: the caller goes on to sleep, so the progress
  // thread must take over now.
  virtual void poll_begin() = 0;
  virtual void poll_end(bool sleeping) = 0;
  // Delivers one mailbox message into PE `pe`'s inbox at the same symmetric
  // place as `local_base` is in this PE. Same results as ring_send. Called
  // with the GIL held; releases it while waiting.
  virtual WaitResult mbox_send(int pe, uintptr_t local_base, size_t nslots, size_t slot_bytes, int64_t tag,
                               uint32_t dtype, int ndim, const int64_t* dims, const void* payload, size_t nbytes,
                               double timeout_s) = 0;
  // put_signal to PE `pe` on another host: `nbytes` from `src` to (region,
  // off), then the signal word (sig_region, sig_off). Called with the GIL
  // held; false with a Python exception set on failure.
  virtual bool put_signal_py(int pe, uint32_t region, uint64_t off, uintptr_t src, uint64_t nbytes,
                             uint32_t sig_region, uint64_t sig_off, uint64_t value, int op) = 0;
};

class Group {
 public:
  Group(int rank, int world_size);
  ~Group();
  void set_peer(int pe, uintptr_t ctrl_addr, int pid);
  // `pe` lives on another host: no control block, its state is what the
  // network engine reports (set_remote_state).
  void set_remote(int pe);
  bool is_remote(int pe) const { return remote_[pe] != 0; }
  void set_remote_state(int pe, uint32_t state);  // kStateClosed, or kStateDead
  // The last barrier round remote PE `pe` completed, as its goodbye said (before set_remote_state).
  void set_remote_done(int pe, uint64_t round) { rdone_[pe].store(round, std::memory_order_release); }
  uint32_t remote_state(int pe) const { return rstate_[pe].load(std::memory_order_acquire); }
  void set_net(NetIface* net) { net_ = net; }
  NetIface* net() const { return net_; }
  // Returns -1 if the wait may go on, else the PE whose death or close makes
  // it hopeless; *why says what happened. `mask` (world_size bytes) is read
  // for dep == kDepSet only.
  // `round`: the barrier round of a kDepBarrier wait.
  int check(int dep, const char** why, const uint8_t* mask = nullptr, uint64_t round = 0) const;
  // True once `pe` died or closed.
  bool gone(int pe) const;
  bool is_dead(int pe) const;
  // True if another PE of this group on this host showed `stamp`'s CPU in
  // its run_stamp within the last `window_us` microseconds before `stamp`
  // and is not asleep: it is likely queued for the CPU this thread holds.
  bool shares_cpu(uint64_t stamp, uint64_t window_us) const;
  int rank() const { return rank_; }
  int world_size() const { return world_; }
  Ctrl* ctrl(int pe) const { return ctrl_[pe]; }
  // Set by Communicator.close(): prepared operations refuse to run after it.
  void mark_closed() { closed_.store(true, std::memory_order_relaxed); }
  bool closed() const { return closed_.load(std::memory_order_relaxed); }

 private:
  bool closed_state(int pe) const;
  std::atomic<bool> closed_{false};
  int rank_, world_;
  std::vector<uint8_t> remote_;
  std::unique_ptr<std::atomic<uint32_t>[]> rstate_;
  std::unique_ptr<std::atomic<uint64_t>[]> rdone_;
  bool completed_round(int pe, uint64_t round) const;
  NetIface* net_ = nullptr;
  std::vector<Ctrl*> ctrl_;
  std::vector<int> pid_;
  std::vector<int> pidfd_;
};

// ---------------------------------------------------------------------------
// Waiting and waking
// ---------------------------------------------------------------------------

enum Cmp : int { kEq = 0, kNe = 1, kGt = 2, kGe = 3, kLt = 4, kLe = 5 };
inline bool cmp_ok(uint64_t v, int cmp, uint64_t ref) {
  switch (cmp) {
    case kEq: return v == ref;
    case kNe: return v != ref;
    case kGt: return v > ref;
    case kGe: return v >= ref;
    case kLt: return v < ref;
    default:  return v <= ref;
  }
}


// A wait-specific check run once per sleep slice (about every 20 ms): returns
// a PE >= 0 to end the wait with kWaitAbandoned (the awaited word was left in
// a state only that PE could finish, and it is gone), else -1.
struct WaitHook {
  virtual int check(uint64_t seen, const char** why) const = 0;
  virtual ~WaitHook() = default;
};

// Waits until cmp(*addr, value) holds (acquire load). `owner` is the control
// block of the PE whose memory holds *addr (its futex is where wakers ring).
// Spins for the calling thread's adaptive budget (at most spin_budget_ns();
// yielding, or moving to another CPU, when another PE of the group runs on
// this CPU: see kernels/sync.cpp), then sleeps on the futex in slices,
// checking liveness of the peers named by `dep` and the deadline. Must be called with the GIL
// held; releases it while sleeping. Python signals (Ctrl-C) are honoured.
WaitResult wait_until(const uint64_t* addr, int cmp, uint64_t value, Ctrl* owner,
                      double timeout_s, const Group* group, int dep, const uint8_t* mask = nullptr,
                      const WaitHook* hook = nullptr);

// Wakes sleepers of `owner` if there are any. Must follow (in program order)
// the seq_cst store/RMW that changed the awaited word.
void wake_if_sleeping(Ctrl* owner);

// Signal update with release semantics for everything written before it
// (implemented seq_cst so the sleeper check cannot be reordered before it).
// op: 0 = set, 1 = add. Returns the previous value.
uint64_t signal_update(uint64_t* addr, uint64_t value, int op, Ctrl* owner);

// Copy helper that releases the GIL for large sizes.
void copy_bytes(void* dst, const void* src, size_t n);

// The most a wait spins before sleeping (ns; each thread adapts its own
// budget below it); configurable via ASAP_SPIN_NS.
int64_t spin_budget_ns();

// ---------------------------------------------------------------------------
// Mailbox: bounded MPSC ring living in the consumer's symmetric memory.
// ---------------------------------------------------------------------------
// Layout of one inbox (the same on every PE):
//   [MailboxHeader (128 B)] [slot 0] [slot 1] ... [slot num_slots-1]
// slot = [SlotHeader (128 B)] [payload: slot_bytes, padded to 64 B]
// Per-slot sequence words, after Vyukov's bounded queue but with the state
// in the low bits, so that every capacity n >= 1 works and a half-written
// slot names its writer:
//   seq = pos << kSeqShift | code
//   code 0                   free for position pos
//   code 1 + pe              claimed by producer `pe` (being written)
//   code kSeqFull            published, ready for the consumer
// A producer owns position p once it CASes the slot from free(p) to
// claimed(p, pe); it then advances the tail (any producer that sees a claimed
// slot at the tail helps advance it, so a producer that dies here wedges
// nobody). It publishes with seq = full(p) (release). The consumer frees the
// slot for position p + n with seq = free(p + n). Vyukov's p + 1 / p + n
// encoding cannot tell "full" from "free" when n == 1.
// Limits: PEs < kSeqFull - 1, positions < 2**(64 - kSeqShift) per inbox.
constexpr int kSeqShift = 17;
constexpr uint64_t kSeqFull = (uint64_t{1} << kSeqShift) - 1;
constexpr uint32_t kMailboxMaxPes = static_cast<uint32_t>(kSeqFull - 1);
inline uint64_t slot_free(uint64_t pos) { return pos << kSeqShift; }
inline uint64_t slot_claimed(uint64_t pos, uint32_t pe) { return (pos << kSeqShift) | (uint64_t{pe} + 1); }
inline uint64_t slot_full(uint64_t pos) { return (pos << kSeqShift) | kSeqFull; }
inline uint64_t seq_pos(uint64_t seq) { return seq >> kSeqShift; }
inline uint64_t seq_code(uint64_t seq) { return seq & kSeqFull; }

constexpr uint32_t kSlotMagic = 0x4d424f58;  // "MBOX"
constexpr int kMaxDims = 8;

struct alignas(64) MailboxHeader {
  uint64_t tail;  // next position to reserve (producers CAS it)
  uint64_t pad0[7];
  uint64_t head;  // next position to consume (consumer only)
  uint64_t pad1[7];
};
static_assert(sizeof(MailboxHeader) == 128, "mailbox header size");

struct alignas(64) SlotHeader {
  uint64_t seq;
  uint32_t magic;
  uint32_t src;
  int64_t tag;
  uint64_t nbytes;
  uint32_t dtype;
  uint32_t ndim;
  int64_t shape[kMaxDims];
  uint64_t pad[2];
};
static_assert(sizeof(SlotHeader) == 128, "slot header size");

constexpr size_t kMailboxHeaderBytes = sizeof(MailboxHeader);
constexpr size_t kSlotHeaderBytes = sizeof(SlotHeader);
inline size_t slot_stride(size_t slot_bytes) {
  return kSlotHeaderBytes + ((slot_bytes + 63) / 64) * 64;
}
inline size_t mailbox_bytes(size_t slot_bytes, size_t num_slots) {
  return kMailboxHeaderBytes + num_slots * slot_stride(slot_bytes);
}

void mailbox_init(uintptr_t base, size_t slot_bytes, size_t num_slots);

// Sends one message (blocking while the ring is full, bounded by timeout_s;
// dst_pe is the consumer, whose death or close ends the wait). On success
// value = the position taken.
WaitResult ring_send(uintptr_t base, size_t nslots, size_t slot_bytes, Ctrl* owner, uint32_t src_pe, int64_t tag,
                     uint32_t dtype, int ndim, const int64_t* dims, const void* payload, size_t nbytes,
                     double timeout_s, const Group* group, int dst_pe);
// The same, for the network engine delivering a remote producer's message:
// never waits and never touches the GIL. kWaitTimeout: the ring is full.
WaitResult ring_try_send(uintptr_t base, size_t nslots, size_t slot_bytes, Ctrl* owner, uint32_t src_pe, int64_t tag,
                         uint32_t dtype, int ndim, const int64_t* dims, const void* payload, size_t nbytes);

struct RecvResult {
  WaitResult wait;
  bool empty;  // poll found nothing
  uint64_t pos;
  uint32_t src, dtype, ndim;
  int64_t tag;
  uint64_t nbytes;
  int64_t dims[kMaxDims];
  uintptr_t payload;
  char error[160];  // non-empty: the header failed validation (slot already released)
  // wait.status == kWaitAbandoned: producer wait.pe died while writing the
  // message at `pos`; the slot was freed and the message dropped.
};
// Takes the next message (timeout_s < 0: never wait). The header is copied
// and bounds-checked before anything uses it. The wait fails (PeerFailure)
// only when every other PE has died or closed; a slot left half-written by a
// producer that died is dropped and reported (kWaitAbandoned) so that the
// messages behind it keep flowing.
RecvResult ring_recv(uintptr_t base, size_t nslots, size_t slot_bytes, uint32_t world, Ctrl* owner, double timeout_s,
                     const Group* group, const uint64_t* itemsizes, uint32_t num_dtypes);
void ring_release(uintptr_t base, size_t nslots, size_t slot_bytes, uint64_t pos, Ctrl* owner);

}  // namespace asap
