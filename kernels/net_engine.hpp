// The network engine: PEs on other hosts, over UCX active messages.
//
// Why active messages, not UCX RMA: over TCP (and any transport without
// hardware RMA) UCX emulates put and atomics with active messages anyway, and
// needs the target to progress. One active message carries a whole operation
// (data, then the signal update), so the target applies it in order, with the
// same atomics and futex wake-ups that same-host peers use, and no memory
// registration or remote key travels. Measured across two network
// namespaces, a UCX active-message round trip costs less than half a UCX put
// round trip (bench/README.md).
//
// Rules (docs/design.md, "Rules every primitive keeps"):
// * Nothing on the wire is an address: a message names a region (0 = the
//   control block, 1 + i = heap chunk i, the same on every PE because chunks
//   are allocated collectively) and an offset; the target bounds-checks both
//   before touching memory and reports a bad message instead of writing.
// * Order: messages from one PE to another are applied in the order they were
//   sent (one endpoint, one lane; every message carries a sequence number and
//   the target counts any gap, which the tests require to stay 0). A put is
//   complete at the source when it returns (the buffer may be reused); a
//   rendezvous-sized put returns only once the target holds the data.
// * Waiting: the caller progresses the engine while it spins; afterwards a
//   progress thread sleeps on the worker's event file descriptor and wakes
//   only when something arrives (or every 100 ms for heart-beats), so an idle
//   PE burns no core.
// * Who may talk: every message travels with UCP_AM_SEND_FLAG_REPLY, so the
//   receiver learns the endpoint it came through. A message is applied only
//   if that endpoint is the one this PE opened to the sender the header
//   names, and that endpoint passed the group's challenge-response at set-up
//   (each PE challenges each remote peer with 32 random bytes; the answer is
//   an HMAC with the group secret, computed and checked in Python: see
//   Communicator._net_handshake). Anything else is dropped and counted
//   (`unauthenticated`). The cost per message is one table lookup.
// * Liveness comes from the kernel, never from a thread the scheduler can
//   starve: each pair of PEs on different hosts holds a "liveness line", a TCP
//   connection that carries no data (set up and authenticated in Python at
//   init, then watched here). The peer's kernel keeps it up while the peer's
//   process lives, however busy or stopped the process is; the process's
//   death closes it at once (EOF or reset), and a lost host or link fails its
//   TCP keepalive probes within the peer timeout (TCP_KEEPIDLE/INTVL and
//   TCP_USER_TIMEOUT). A PE that closes writes a goodbye byte (with the last
//   barrier round it completed) on the line and says so over UCX too (CLOSE).
//   UCX reporting an endpoint error also marks the PE dead. Load can delay a
//   verdict (the thread that reads the line may run late) but never fake one.
//   Every wait that depends on a dead PE raises PeerFailure.
// * Fence: nothing a PE sends after it is marked dead is applied (dropped and
//   counted, `fenced`): a lost host still in the network, or back on its link,
//   cannot write into memory its replacement owns (docs/failover.md). A PE is
//   marked dead by its failed liveness line, a UCX endpoint error, or fence()
//   (the front end named it dead). A rendezvous-sized put lands in a buffer
//   first and is applied only if its sender is still not dead when its data is
//   complete, so a transfer begun before the verdict cannot land after it.
//
//
// Where each concern lives (one NetEngine, its methods by file):
//   net_ucx.hpp/.cpp   UCX, loaded at run time (dlopen and the symbol table)
//   net_wire.hpp       the message header and kinds
//   net_engine.cpp     set-up, the operations Python calls, stats, shutdown
//   net_request.cpp    sending, and requests that await a reply (pending slots)
//   net_recv.cpp       receiving: applying messages, replies, rendezvous data
//   net_liveness.cpp   the liveness lines (watch, read, drop)
//   net_progress.cpp   polling, and the progress thread
//   net_py.cpp         the Python bindings (asap_comm._C.NetEngine, net_load)
#pragma once
#ifdef ASAP_HAVE_UCX
#include <Python.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "asap_shm.hpp"
#include "net_ucx.hpp"
#include "net_wire.hpp"

namespace asap::net {

using Clock = std::chrono::steady_clock;


struct Pending {
  void* dst = nullptr;  // get: where the bytes go
  size_t cap = 0;
  uint32_t gen = 0;
  bool busy = false;
  std::atomic<int> done{0};
  int32_t status = 0;
  uint64_t value = 0;
  int pe = -1;
  char error[160] = {0};
};

class NetEngine;

// Context of a rendezvous receive (freed in its completion).
struct RndvCtx {
  NetEngine* eng;
  Hdr h;
  std::vector<char> tmp;  // mailbox payloads land here first
};

// Thrown (GIL held) when a Python exception is already set, e.g. a
// TimeoutError or PeerFailure from raise_wait_error: the binding passes it on.
struct PythonError {};

// The counters behind Communicator.net_stats() (net_py.cpp makes the dict).
struct NetStats {
  uint64_t disorder = 0, bad_messages = 0, unauthenticated = 0, fenced = 0, received = 0, sent = 0;
  uint64_t mbox_unanswered = 0, mbox_resumed = 0, mbox_abandoned = 0;
  int liveness_lines = 0;
  uint64_t progress_wakeups = 0, progress_parks = 0;
  std::string last_error;
};

class NetEngine final : public NetIface {
 public:
  // A set-up message received: kind is kHello (a challenge) or kHelloAck (an answer).
  struct Handshake {
    int pe;
    uint32_t kind;
    std::string payload;
  };

  NetEngine(Group* group, uintptr_t own_ctrl, double peer_timeout_s, const std::string& tls);
  ~NetEngine() override { shutdown(); }

  // ---------------------------------------------------------------- set-up (net_engine.cpp, net_liveness.cpp)
  std::string address();  // this worker's UCX address (bytes)
  void connect(int pe, const std::string& addr);
  // The liveness line to PE `pe` (a connected TCP socket, already authenticated): the engine keeps a
  // duplicate of `fd`, sets its keepalive so that a lost host or link fails it within the peer timeout,
  // and watches it from then on (before start()).
  void watch(int pe, int fd);
  // Starts the progress thread (after every connect).
  void start();
  // authentication (set-up, before start)
  void handshake_send(int pe, bool answer, const std::string& payload);
  // The handshake messages received since the last call.
  std::vector<Handshake> take_handshakes();
  void authenticate(int pe);
  // PE `pe` is dead from now on, as the group decided (the front end's failover: its own liveness line may
  // not have failed yet): the same verdict a failed liveness line gives, so nothing it sends is applied
  // (see "Fence" below) and every wait on it fails. No effect on a PE that closed or is dead already.
  void fence(int pe);
  void add_region(uint32_t index, uintptr_t base, size_t size);

  // ---------------------------------------------------------------- operations (GIL held on entry)
  void put(int pe, uint32_t region, uint64_t off, uintptr_t src, uint64_t nbytes);
  void put_signal(int pe, uint32_t region, uint64_t off, uintptr_t src, uint64_t nbytes, uint32_t sig_region,
                  uint64_t sig_off, uint64_t value, int op);
  bool put_signal_py(int pe, uint32_t region, uint64_t off, uintptr_t src, uint64_t nbytes, uint32_t sig_region,
                     uint64_t sig_off, uint64_t value, int op) override;
  // fetch: wait for the target's answer and return the previous value.
  uint64_t signal(int pe, uint32_t region, uint64_t off, uint64_t value, int op, bool fetch, double timeout_s);
  void get(int pe, uint32_t region, uint64_t off, uintptr_t dst, uint64_t nbytes, double timeout_s);
  void quiet(double timeout_s);
  WaitResult mbox_send(int pe, uintptr_t local_base, size_t nslots, size_t slot_bytes, int64_t tag, uint32_t dtype,
                       int ndim, const int64_t* dims, const void* payload, size_t nbytes, double timeout_s) override;

  // ---------------------------------------------------------------- progress (net_progress.cpp)
  void poll() override;
  void poll_begin() override { pollers_.fetch_add(1, std::memory_order_relaxed); }
  void poll_end(bool sleeping) override;

  NetStats stats();
  // Tells the remote PEs this one leaves, stops the progress thread, closes
  // the endpoints and frees the worker. Idempotent.
  void shutdown();

 private:
  struct Region {
    char* base;
    size_t size;
  };
  struct Deferred {
    int pe;
    Hdr h;
    const char* data = nullptr;
    size_t n = 0;
  };
  // helpers (net_engine.cpp)
  void check_pe(const char* fn, int pe) const;
  Hdr make(uint32_t kind, int pe);
  Hdr header(uint32_t kind) const;
  bool locate(uintptr_t addr, size_t n, uint32_t* region, uint64_t* off);
  char* resolve(uint32_t region, uint64_t off, uint64_t n) const;

  // sending and requests (net_request.cpp)
  void* send_nb(int pe, Hdr& h, const void* data, size_t n);
  bool wait_req_locked(void* req, double timeout_s);
  void send_blocking(int pe, Hdr& h, const void* data, size_t n, const char* fn);
  int wait_req(void* req, int pe, double timeout_s);
  void ensure_alive(int pe, const char* fn);
  [[noreturn]] void throw_peer(const char* fn, int pe, const char* why);
  Pending* alloc_pending(int pe, void* dst, size_t cap, uint32_t* token);
  void free_pending(Pending* p);
  Pending* lookup(uint32_t token);
  Pending* request(int pe, Hdr& h, const void* data, size_t n, void* dst, size_t cap, double timeout_s,
                   const char* fn);
  Pending* request_nothrow(int pe, Hdr& h, const void* data, size_t n, void* dst, size_t cap, double timeout_s,
                           WaitResult* res, bool keep_unanswered = false);
  // Waits (GIL released by the caller) for the reply to `p`, sent to `pe`: 1 answered, 2 timed out while `pe`
  // lives, 3 `pe` died or closed (*why says how).
  int await_reply(Pending* p, int pe, double timeout_s, const char** why);
  void complete(Pending* p);

  // receiving (net_recv.cpp; mu_ held)
  static ucs_status_t on_am(void* arg, const void* header, size_t header_length, void* data, size_t length,
                            const ucp_am_recv_param_t* param);
  static void on_ep_error(void* arg, ucp_ep_h ep, ucs_status_t);
  void mark(int pe, uint32_t state);
  void reply(int pe, const Hdr& req, int32_t status, uint64_t value, const char* data, size_t n);
  ucs_status_t handle(Hdr& h, void* data, size_t length, bool rndv, ucp_ep_h via);
  bool fenced(int src, const Hdr& h);  // src is dead: count the message as fenced
  void finish_put(const Hdr& h);
  void deliver_mbox(const Hdr& h, const void* payload);
  ucs_status_t recv_rndv(const Hdr& h, void* desc, char* dst, size_t length);
  static void on_rndv_done(void* req, ucs_status_t st, size_t, void* user);
  void rndv_finished(RndvCtx* c, ucs_status_t st);
  ucs_status_t on_reply(const Hdr& h, void* data, size_t length, bool rndv);
  void run_deferred();

  // liveness (net_liveness.cpp; mu_ held)
  void check_line(int pe);
  void drop_line(int pe);
  void tick();

  // progress (net_progress.cpp)
  static int64_t now_ns();
  void maybe_tick();
  void unpark();
  void progress_loop();

  Group* group_;
  int rank_, world_;
  Ctrl* own_;
  int64_t peer_timeout_ns_;
  double send_timeout_s_ = 30.0;
  ucp_context_h ctx_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int efd_ = -1;
  std::vector<ucp_ep_h> eps_;
  std::vector<uint64_t> tx_seq_, rx_seq_;
  std::vector<int> lines_;  // per PE: its liveness line (a TCP socket), -1 if none
  std::vector<std::string> line_buf_;  // bytes read from each line
  int line_epoll_ = -1;  // the progress thread's epoll, while it runs
  std::vector<uint8_t> dirty_ = std::vector<uint8_t>(world_, 0);
  std::vector<Region> regions_;
  std::deque<Pending> pending_;
  std::deque<Deferred> deferred_;
  std::mutex mu_, pend_mu_, cv_mu_;
  std::condition_variable cv_;
  std::thread thread_;
  bool stop_ = false;
  std::atomic<int> pollers_{0};
  std::atomic<int64_t> last_poll_ns_{0};
  std::mutex park_mu_;
  std::condition_variable park_cv_;
  Clock::time_point last_tick_ = Clock::now();
  uint64_t parks_ = 0;
  bool debug_ = std::getenv("ASAP_NET_DEBUG") != nullptr;
  uint64_t disorder_ = 0, bad_ = 0, received_ = 0, sent_ = 0, wakeups_ = 0, unauth_ = 0, fenced_ = 0;
  std::vector<uint8_t> authed_ = std::vector<uint8_t>(world_, 0);  // the peer answered this PE's challenge
  std::mutex hs_mu_;
  std::vector<Handshake> handshakes_;  // received, for Python to answer or check
  std::string last_error_;
  // A mailbox message whose answer (placed, or full) did not come within its send's bound: the peer's process
  // lives but did not answer (stopped, say), so it may still place the message. The send raised TimeoutError;
  // offering the same message again (same mailbox, tag, dtype, shape and bytes) awaits this answer instead of
  // sending a copy, so a caller that retries never duplicates a message; a different message abandons it (its
  // late answer is dropped; it may still be placed, before the new one). Touched with the GIL held only.
  struct Unanswered {
    Pending* p = nullptr;
    uintptr_t base = 0;
    int64_t tag = 0;
    uint32_t dtype = 0;
    int ndim = 0;
    int64_t dims[kMaxDims] = {};
    std::string bytes;
  };
  std::vector<Unanswered> unanswered_ = std::vector<Unanswered>(world_);
  uint64_t mbox_unanswered_ = 0, mbox_resumed_ = 0, mbox_abandoned_ = 0;
};

}  // namespace asap::net
#endif  // ASAP_HAVE_UCX
