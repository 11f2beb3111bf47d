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
// Rules (DESIGN.md, "Rules every primitive keeps"):
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
//
// UCX is loaded at run time (dlopen of the libraries the libucx wheel ships),
// so this module builds against UCX's headers but imports and runs without
// UCX when every PE is on one host.
#include <Python.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "asap_shm.hpp"
#include "ctrl.hpp"
#include "handles.hpp"

#ifdef ASAP_HAVE_UCX

#include <dlfcn.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <ucp/api/ucp.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace py = pybind11;

namespace asap {
namespace {

using Clock = std::chrono::steady_clock;

// ------------------------------------------------------------------ UCX, loaded at run time
struct Ucx {
#define ASAP_UCX_FN(name) decltype(&::name) name = nullptr
  ASAP_UCX_FN(ucp_config_read);
  ASAP_UCX_FN(ucp_config_modify);
  ASAP_UCX_FN(ucp_config_release);
  ASAP_UCX_FN(ucp_init_version);
  ASAP_UCX_FN(ucp_cleanup);
  ASAP_UCX_FN(ucp_worker_create);
  ASAP_UCX_FN(ucp_worker_destroy);
  ASAP_UCX_FN(ucp_worker_query);
  ASAP_UCX_FN(ucp_worker_release_address);
  ASAP_UCX_FN(ucp_worker_progress);
  ASAP_UCX_FN(ucp_worker_get_efd);
  ASAP_UCX_FN(ucp_worker_arm);
  ASAP_UCX_FN(ucp_worker_signal);
  ASAP_UCX_FN(ucp_worker_set_am_recv_handler);
  ASAP_UCX_FN(ucp_ep_create);
  ASAP_UCX_FN(ucp_ep_close_nbx);
  ASAP_UCX_FN(ucp_am_send_nbx);
  ASAP_UCX_FN(ucp_am_recv_data_nbx);
  ASAP_UCX_FN(ucp_request_check_status);
  ASAP_UCX_FN(ucp_request_free);
  ASAP_UCX_FN(ucs_status_string);
#undef ASAP_UCX_FN
  bool loaded = false;
};
Ucx ucx;
std::mutex g_load_mu;

void load_ucx(const std::string& ucp_path, const std::string& ucs_path) {
  std::lock_guard<std::mutex> g(g_load_mu);
  if (ucx.loaded) return;
  void* hs = dlopen(ucs_path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (hs == nullptr) throw std::runtime_error(std::string("net: cannot load ") + ucs_path + ": " + dlerror());
  void* hp = dlopen(ucp_path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (hp == nullptr) throw std::runtime_error(std::string("net: cannot load ") + ucp_path + ": " + dlerror());
  auto sym = [&](void* h, const char* name) {
    void* p = dlsym(h, name);
    if (p == nullptr) throw std::runtime_error(std::string("net: UCX library lacks ") + name);
    return p;
  };
#define ASAP_UCX_LOAD(h, name) ucx.name = reinterpret_cast<decltype(ucx.name)>(sym(h, #name))
  ASAP_UCX_LOAD(hp, ucp_config_read);
  ASAP_UCX_LOAD(hp, ucp_config_modify);
  ASAP_UCX_LOAD(hp, ucp_config_release);
  ASAP_UCX_LOAD(hp, ucp_init_version);
  ASAP_UCX_LOAD(hp, ucp_cleanup);
  ASAP_UCX_LOAD(hp, ucp_worker_create);
  ASAP_UCX_LOAD(hp, ucp_worker_destroy);
  ASAP_UCX_LOAD(hp, ucp_worker_query);
  ASAP_UCX_LOAD(hp, ucp_worker_release_address);
  ASAP_UCX_LOAD(hp, ucp_worker_progress);
  ASAP_UCX_LOAD(hp, ucp_worker_get_efd);
  ASAP_UCX_LOAD(hp, ucp_worker_arm);
  ASAP_UCX_LOAD(hp, ucp_worker_signal);
  ASAP_UCX_LOAD(hp, ucp_worker_set_am_recv_handler);
  ASAP_UCX_LOAD(hp, ucp_ep_create);
  ASAP_UCX_LOAD(hp, ucp_ep_close_nbx);
  ASAP_UCX_LOAD(hp, ucp_am_send_nbx);
  ASAP_UCX_LOAD(hp, ucp_am_recv_data_nbx);
  ASAP_UCX_LOAD(hp, ucp_request_check_status);
  ASAP_UCX_LOAD(hp, ucp_request_free);
  ASAP_UCX_LOAD(hs, ucs_status_string);
#undef ASAP_UCX_LOAD
  ucx.loaded = true;
}

std::string ucs_err(const char* what, ucs_status_t st) {
  return std::string("net: ") + what + " failed: " + ucx.ucs_status_string(st);
}

// ------------------------------------------------------------------ wire format
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

const char* kind_name(uint32_t k) {
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

class NetEngine final : public NetIface {
 public:
  NetEngine(Group* group, uintptr_t own_ctrl, double peer_timeout_s, const std::string& tls)
      : group_(group), rank_(group->rank()), world_(group->world_size()), own_(reinterpret_cast<Ctrl*>(own_ctrl)),
        peer_timeout_ns_(static_cast<int64_t>(peer_timeout_s * 1e9)),
        eps_(world_, nullptr), tx_seq_(world_, 0), rx_seq_(world_, 0), lines_(world_, -1), line_buf_(world_),
        pending_(256) {
    if (!ucx.loaded) throw std::runtime_error("net: UCX is not loaded");
    ucp_config_t* cfg = nullptr;
    ucs_status_t st = ucx.ucp_config_read(nullptr, nullptr, &cfg);
    if (st != UCS_OK) throw std::runtime_error(ucs_err("ucp_config_read", st));
    if (!tls.empty()) {
      st = ucx.ucp_config_modify(cfg, "TLS", tls.c_str());
      if (st != UCS_OK) {
        ucx.ucp_config_release(cfg);
        throw std::runtime_error(ucs_err(("setting UCX_TLS=" + tls).c_str(), st));
      }
    }
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    params.mt_workers_shared = 0;
    st = ucx.ucp_init_version(UCP_API_MAJOR, UCP_API_MINOR, &params, cfg, &ctx_);
    ucx.ucp_config_release(cfg);
    if (st != UCS_OK) throw std::runtime_error(ucs_err("ucp_init", st));
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;  // our mutex serialises every call
    st = ucx.ucp_worker_create(ctx_, &wp, &worker_);
    if (st != UCS_OK) {
      ucx.ucp_cleanup(ctx_);
      throw std::runtime_error(ucs_err("ucp_worker_create", st));
    }
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                    UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    hp.id = kAmId;
    hp.flags = UCP_AM_FLAG_WHOLE_MSG;
    hp.cb = &NetEngine::on_am;
    hp.arg = this;
    st = ucx.ucp_worker_set_am_recv_handler(worker_, &hp);
    if (st == UCS_OK) st = ucx.ucp_worker_get_efd(worker_, &efd_);
    if (st != UCS_OK) {
      ucx.ucp_worker_destroy(worker_);
      ucx.ucp_cleanup(ctx_);
      throw std::runtime_error(ucs_err("worker set-up", st));
    }
    // region 0: this PE's control block
    regions_.push_back({reinterpret_cast<char*>(own_ctrl), kCtrlBytes});
  }

  ~NetEngine() override { shutdown(); }

  // ---------------------------------------------------------------- set-up
  py::bytes address() {
    std::lock_guard<std::mutex> g(mu_);
    ucp_worker_attr_t attr{};
    attr.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS;
    ucs_status_t st = ucx.ucp_worker_query(worker_, &attr);
    if (st != UCS_OK) throw std::runtime_error(ucs_err("ucp_worker_query", st));
    py::bytes out(reinterpret_cast<const char*>(attr.address), attr.address_length);
    ucx.ucp_worker_release_address(worker_, attr.address);
    return out;
  }

  void connect(int pe, const std::string& addr) {
    check_pe("connect", pe);
    std::lock_guard<std::mutex> g(mu_);
    if (eps_[pe] != nullptr) throw std::runtime_error("net: connect: PE " + std::to_string(pe) + " already connected");
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(addr.data());
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = &NetEngine::on_ep_error;
    ep.err_handler.arg = this;
    ucs_status_t st = ucx.ucp_ep_create(worker_, &ep, &eps_[pe]);
    if (st != UCS_OK) throw std::runtime_error(ucs_err(("ucp_ep_create to PE " + std::to_string(pe)).c_str(), st));
    group_->set_remote(pe);
  }

  // The liveness line to PE `pe` (a connected TCP socket, already authenticated): the engine keeps a
  // duplicate of `fd`, sets its keepalive so that a lost host or link fails it within the peer timeout,
  // and watches it from then on (before start()).
  void watch(int pe, int fd) {
    check_pe("watch", pe);
    std::lock_guard<std::mutex> g(mu_);
    if (eps_[pe] == nullptr) throw std::invalid_argument("net: watch: PE " + std::to_string(pe) + " is not connected");
    if (lines_[pe] >= 0) throw std::invalid_argument("net: watch: PE " + std::to_string(pe) + " has a line already");
    const int d = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (d < 0) throw std::runtime_error(std::string("net: watch: dup: ") + std::strerror(errno));
    const int one = 1;
    const int idle = 1, intvl = 1;
    const int secs = std::max(1, static_cast<int>(std::ceil(static_cast<double>(peer_timeout_ns_) / 1e9)));
    const int cnt = std::max(1, secs);
    const unsigned user_ms = static_cast<unsigned>(secs) * 1000u;
    if (setsockopt(d, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one) != 0 ||
        setsockopt(d, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle) != 0 ||
        setsockopt(d, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl) != 0 ||
        setsockopt(d, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt) != 0 ||
        setsockopt(d, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_ms, sizeof user_ms) != 0 ||
        fcntl(d, F_SETFL, fcntl(d, F_GETFL) | O_NONBLOCK) != 0) {
      const std::string err = std::strerror(errno);
      ::close(d);
      throw std::runtime_error("net: watch: setting up the liveness line failed: " + err);
    }
    lines_[pe] = d;
  }

  // Starts the progress thread (after every connect).
  void start() {
    std::lock_guard<std::mutex> g(mu_);
    if (thread_.joinable()) return;
    stop_ = false;
    thread_ = std::thread([this] { progress_loop(); });
  }

  // ---------------------------------------------------------------- authentication (set-up, before start)
  // Sends PE `pe` a handshake message (a challenge or an answer: 32 bytes).
  void handshake_send(int pe, bool answer, const std::string& payload) {
    if (payload.size() != kHandshakeBytes)
      throw std::invalid_argument("net: handshake: the payload must be " + std::to_string(kHandshakeBytes) + " bytes");
    Hdr h = make(answer ? kHelloAck : kHello, pe);
    h.nbytes = payload.size();
    send_blocking(pe, h, payload.data(), payload.size(), answer ? "handshake answer" : "handshake challenge");
  }

  // The handshake messages received since the last call: [(pe, "challenge"|"answer", payload)].
  py::list take_handshakes() {
    std::vector<Handshake> got;
    {
      std::lock_guard<std::mutex> g(hs_mu_);
      got.swap(handshakes_);
    }
    py::list out;
    for (const auto& x : got)
      out.append(py::make_tuple(x.pe, x.kind == kHello ? "challenge" : "answer", py::bytes(x.payload)));
    return out;
  }

  // PE `pe` answered this PE's challenge correctly: from now on its messages are applied.
  void authenticate(int pe) {
    check_pe("authenticate", pe);
    std::lock_guard<std::mutex> g(mu_);
    if (eps_[pe] == nullptr) throw std::invalid_argument("net: authenticate: PE " + std::to_string(pe) + " is not connected");
    authed_[pe] = 1;
  }

  void add_region(uint32_t index, uintptr_t base, size_t size) {
    std::lock_guard<std::mutex> g(mu_);
    if (index != regions_.size())
      throw std::runtime_error("net: add_region: region " + std::to_string(index) + " out of order (have " +
                               std::to_string(regions_.size()) + ")");
    regions_.push_back({reinterpret_cast<char*>(base), size});
  }

  // ---------------------------------------------------------------- operations (GIL held on entry)
  void put(int pe, uint32_t region, uint64_t off, uintptr_t src, uint64_t nbytes) {
    Hdr h = make(kPut, pe);
    h.region = region;
    h.off = off;
    h.nbytes = nbytes;
    send_blocking(pe, h, reinterpret_cast<const void*>(src), nbytes, "put");
  }

  void put_signal(int pe, uint32_t region, uint64_t off, uintptr_t src, uint64_t nbytes, uint32_t sig_region,
                  uint64_t sig_off, uint64_t value, int op) {
    Hdr h = make(kPutSignal, pe);
    h.region = region;
    h.off = off;
    h.nbytes = nbytes;
    h.sig_region = sig_region;
    h.sig_off = sig_off;
    h.value = value;
    h.op = static_cast<uint32_t>(op);
    send_blocking(pe, h, reinterpret_cast<const void*>(src), nbytes, "put_signal");
  }

  bool put_signal_py(int pe, uint32_t region, uint64_t off, uintptr_t src, uint64_t nbytes, uint32_t sig_region,
                     uint64_t sig_off, uint64_t value, int op) override {
    try {
      put_signal(pe, region, off, src, nbytes, sig_region, sig_off, value, op);
      return true;
    } catch (py::error_already_set& e) {
      e.restore();
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
    return false;
  }

  // fetch: wait for the target's answer and return the previous value.
  uint64_t signal(int pe, uint32_t region, uint64_t off, uint64_t value, int op, bool fetch, double timeout_s) {
    Hdr h = make(fetch ? kSignalFetch : kSignal, pe);
    h.sig_region = region;
    h.sig_off = off;
    h.value = value;
    h.op = static_cast<uint32_t>(op);
    if (!fetch) {
      send_blocking(pe, h, nullptr, 0, "signal_op");
      return 0;
    }
    Pending* p = request(pe, h, nullptr, 0, nullptr, 0, timeout_s, "signal_op");
    const uint64_t v = p->value;
    free_pending(p);
    return v;
  }

  void get(int pe, uint32_t region, uint64_t off, uintptr_t dst, uint64_t nbytes, double timeout_s) {
    Hdr h = make(kGet, pe);
    h.region = region;
    h.off = off;
    h.nbytes = nbytes;
    Pending* p = request(pe, h, nullptr, 0, reinterpret_cast<void*>(dst), nbytes, timeout_s, "get");
    free_pending(p);
  }

  // Completes every operation this PE issued to the named remote PEs (all
  // when empty): their effects are visible at the targets on return.
  void quiet(double timeout_s) {
    for (int pe = 0; pe < world_; ++pe) {
      if (eps_[pe] == nullptr || !dirty_[pe]) continue;
      if (group_->remote_state(pe) != kStateAlive) continue;
      Hdr h = make(kQuiet, pe);
      WaitResult r{kWaitOk, 0, -1, nullptr};
      Pending* p = request_nothrow(pe, h, nullptr, 0, nullptr, 0, timeout_s, &r);
      if (p != nullptr) {
        free_pending(p);
      } else if (!(r.status == kWaitPeer && group_->remote_state(pe) == kStateClosed)) {
        // (a PE that closed meanwhile has nothing left to complete)
        if (r.status == kWaitInterrupted) throw py::error_already_set();
        PyObject* what = PyUnicode_FromString("quiet");
        raise_wait_error(r, timeout_s, what, false);
        Py_XDECREF(what);
        throw py::error_already_set();
      }
      dirty_[pe] = 0;
    }
  }

  WaitResult mbox_send(int pe, uintptr_t local_base, size_t nslots, size_t slot_bytes, int64_t tag, uint32_t dtype,
                       int ndim, const int64_t* dims, const void* payload, size_t nbytes, double timeout_s) override {
    uint32_t region = 0;
    uint64_t off = 0;
    if (!locate(local_base, mailbox_bytes(slot_bytes, nslots), &region, &off))
      return {kWaitPeer, 0, pe, "cannot be reached: the mailbox is not in a registered region"};
    const auto start = Clock::now();
    int64_t backoff_us = 20;
    for (;;) {
      if (group_->remote_state(pe) == kStateClosed) return {kWaitOk, 0, -1, nullptr};  // dropped, as on one host
      Hdr h = make(kMbox, pe);
      h.region = region;
      h.off = off;
      h.nslots = nslots;
      h.slot_bytes = slot_bytes;
      h.tag = tag;
      h.dtype = dtype;
      h.ndim = static_cast<uint32_t>(ndim);
      for (int i = 0; i < ndim; ++i) h.dims[i] = dims[i];
      h.nbytes = nbytes;
      const double spent = std::chrono::duration<double>(Clock::now() - start).count();
      WaitResult r{kWaitOk, 0, -1, nullptr};
      // The answer (placed, or full) is awaited even past a short timeout: `timeout` bounds the wait for
      // room in the ring, and a send that gave up before the answer could not say whether the message was
      // placed (a caller that retries would duplicate it). kAnswerS bounds a peer that never answers.
      constexpr double kAnswerS = 10.0;
      Pending* p = request_nothrow(pe, h, payload, nbytes, nullptr, 0, std::max(timeout_s - spent, kAnswerS), &r);
      if (p == nullptr) {
        if (r.status == kWaitPeer && group_->remote_state(pe) == kStateClosed) return {kWaitOk, 0, -1, nullptr};
        return r;
      }
      const int32_t status = p->status;
      const uint64_t pos = p->value;
      free_pending(p);
      if (status == kReplyOk) return {kWaitOk, pos, -1, nullptr};
      if (status == kReplyBad) return {kWaitPeer, 0, pe, "rejected the message (mailbox region out of bounds)"};
      // Full: back off and offer it again (the message was not kept).
      const double now_spent = std::chrono::duration<double>(Clock::now() - start).count();
      if (now_spent >= timeout_s) return {kWaitTimeout, 0, -1, nullptr};
      const char* why = nullptr;
      if (group_->check(pe, &why) >= 0) return {kWaitPeer, 0, pe, why};
      Py_BEGIN_ALLOW_THREADS
      std::this_thread::sleep_for(std::chrono::microseconds(backoff_us));
      Py_END_ALLOW_THREADS
      if (PyErr_CheckSignals() != 0) return {kWaitInterrupted, 0, -1, nullptr};
      backoff_us = std::min<int64_t>(backoff_us * 2, 1000);
    }
  }

  void poll() override {
    std::unique_lock<std::mutex> g(mu_, std::try_to_lock);
    if (!g.owns_lock() || worker_ == nullptr) return;
    while (ucx.ucp_worker_progress(worker_) != 0) {
    }
    run_deferred();
    maybe_tick();
  }

  void poll_begin() override { pollers_.fetch_add(1, std::memory_order_relaxed); }

  void poll_end(bool sleeping) override {
    // going to sleep: no grace period, the progress thread takes over now
    last_poll_ns_.store(sleeping ? 0 : now_ns(), std::memory_order_relaxed);
    if (pollers_.fetch_sub(1, std::memory_order_acq_rel) == 1 && sleeping) unpark();
  }

  py::dict stats() {
    std::lock_guard<std::mutex> g(mu_);
    py::dict d;
    d["disorder"] = disorder_;
    d["bad_messages"] = bad_;
    d["unauthenticated"] = unauth_;
    d["received"] = received_;
    d["sent"] = sent_;
    int lines = 0;
    for (int fd : lines_) lines += fd >= 0;
    d["liveness_lines"] = lines;
    d["progress_wakeups"] = wakeups_;
    d["progress_parks"] = parks_;
    d["last_error"] = last_error_;
    return d;
  }

  // Tells the remote PEs this one leaves, stops the progress thread, closes
  // the endpoints and frees the worker. Idempotent.
  void shutdown() {
    if (worker_ == nullptr) return;
    // Goodbye first, acknowledged (within a second), so that peers record
    // this PE as closed, not dead, before its endpoints go away.
    std::vector<Pending*> byes;
    {
      std::lock_guard<std::mutex> g(mu_);
      for (int pe = 0; pe < world_; ++pe) {
        if (eps_[pe] == nullptr || group_->remote_state(pe) != kStateAlive) continue;
        uint32_t token = 0;
        Pending* p = alloc_pending(pe, nullptr, 0, &token);
        if (p == nullptr) continue;
        Hdr h = header(kClose);
        h.token = token;
        h.value = std::atomic_ref<uint64_t>(own_->barrier_done).load(std::memory_order_acquire);  // rounds done
        void* req = send_nb(pe, h, nullptr, 0);
        if (req != nullptr && req != reinterpret_cast<void*>(-1)) ucx.ucp_request_free(req);
        byes.push_back(p);
      }
    }
    const auto deadline = Clock::now() + std::chrono::seconds(1);
    for (;;) {
      bool all = true;
      for (Pending* p : byes)
        if (!p->done.load(std::memory_order_acquire) && group_->remote_state(p->pe) == kStateAlive) all = false;
      if (all || Clock::now() > deadline) break;
      poll();
      std::this_thread::yield();
    }
    if (debug_)
      for (Pending* p : byes)
        fprintf(stderr, "[asap net] PE %d: goodbye to PE %d %s\n", rank_, p->pe,
                p->done.load() ? "acknowledged" : "not acknowledged");
    for (Pending* p : byes) free_pending(p);
    {
      std::lock_guard<std::mutex> g(mu_);
      char bye[kByeBytes];
      bye[0] = 'B';
      const uint64_t done = std::atomic_ref<uint64_t>(own_->barrier_done).load(std::memory_order_acquire);
      std::memcpy(bye + 1, &done, sizeof done);
      for (int pe = 0; pe < world_; ++pe) {
        if (lines_[pe] < 0) continue;
        if (::write(lines_[pe], bye, sizeof bye) < 0) {
          // the peer's end is gone already: nothing to tell
        }
        drop_line(pe);
      }
    }
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
      ucx.ucp_worker_signal(worker_);
    }
    unpark();
    if (thread_.joinable()) thread_.join();
    std::lock_guard<std::mutex> g(mu_);
    for (int pe = 0; pe < world_; ++pe) {
      if (eps_[pe] == nullptr) continue;
      ucp_request_param_t rp{};
      rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      rp.flags = UCP_EP_CLOSE_FLAG_FORCE;
      void* req = ucx.ucp_ep_close_nbx(eps_[pe], &rp);
      if (req != nullptr && !UCS_PTR_IS_ERR(req)) wait_req_locked(req, 1.0);
      eps_[pe] = nullptr;
    }
    ucx.ucp_worker_destroy(worker_);
    worker_ = nullptr;
    ucx.ucp_cleanup(ctx_);
    ctx_ = nullptr;
    group_->set_net(nullptr);
  }


 private:
  struct Region {
    char* base;
    size_t size;
  };

  void check_pe(const char* fn, int pe) const {
    if (pe < 0 || pe >= world_)
      throw std::invalid_argument(std::string("net: ") + fn + ": PE " + std::to_string(pe) + " out of range [0, " +
                                  std::to_string(world_) + ")");
  }

  Hdr make(uint32_t kind, int pe) {
    check_pe(kind_name(kind), pe);
    if (eps_[pe] == nullptr)
      throw std::invalid_argument(std::string("net: ") + kind_name(kind) + ": PE " + std::to_string(pe) +
                                  " is not a remote PE of this group");
    return header(kind);
  }
  // A header for this PE (no checks: the engine's own messages).
  Hdr header(uint32_t kind) const {
    Hdr h{};
    h.kind = kind;
    h.src = static_cast<uint32_t>(rank_);
    return h;
  }

  bool locate(uintptr_t addr, size_t n, uint32_t* region, uint64_t* off) {
    std::lock_guard<std::mutex> g(mu_);
    for (size_t i = 1; i < regions_.size(); ++i) {
      const auto b = reinterpret_cast<uintptr_t>(regions_[i].base);
      if (addr >= b && addr - b <= regions_[i].size && n <= regions_[i].size - (addr - b)) {
        *region = static_cast<uint32_t>(i);
        *off = addr - b;
        return true;
      }
    }
    return false;
  }

  // Resolves (region, off, n) in this PE's memory; nullptr if out of bounds.
  char* resolve(uint32_t region, uint64_t off, uint64_t n) const {
    if (region >= regions_.size()) return nullptr;
    const Region& r = regions_[region];
    if (off > r.size || n > r.size - off) return nullptr;
    return r.base + off;
  }

  // Issues one send (mu_ held). Returns the UCX request, or nullptr when done.
  void* send_nb(int pe, Hdr& h, const void* data, size_t n) {
    h.seq = tx_seq_[pe]++;
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = UCP_AM_SEND_FLAG_COPY_HEADER | UCP_AM_SEND_FLAG_REPLY;  // the receiver checks the endpoint
    void* req = ucx.ucp_am_send_nbx(eps_[pe], kAmId, &h, sizeof h, data, n, &rp);
    ++sent_;
    if (UCS_PTR_IS_ERR(req)) {
      last_error_ = ucs_err("ucp_am_send_nbx", UCS_PTR_STATUS(req));
      return reinterpret_cast<void*>(-1);
    }
    return req;
  }

  // Waits (mu_ held, progressing) for a request; frees it. False on timeout
  // or error (the request is then freed too).
  bool wait_req_locked(void* req, double timeout_s) {
    if (req == reinterpret_cast<void*>(-1)) return false;
    const auto deadline = Clock::now() + std::chrono::nanoseconds(static_cast<int64_t>(timeout_s * 1e9));
    ucs_status_t st;
    while ((st = ucx.ucp_request_check_status(req)) == UCS_INPROGRESS) {
      ucx.ucp_worker_progress(worker_);
      if (Clock::now() > deadline) break;
    }
    ucx.ucp_request_free(req);
    return st == UCS_OK;
  }

  // A send whose completion the caller waits for (the source buffer is free
  // again on return). Raises the documented errors. The engine's lock is
  // dropped between progress calls, so the progress thread keeps answering
  // (and heart-beating) while a large message drains.
  void send_blocking(int pe, Hdr& h, const void* data, size_t n, const char* fn) {
    // A PE that closed reads nothing any more: a one-way write to it is
    // dropped, as a write into a closed peer's memory is on one host.
    if (group_->remote_state(pe) == kStateClosed) return;
    ensure_alive(pe, fn);
    void* req;
    PyThreadState* ts = nullptr;
    {
      std::unique_lock<std::mutex> g(mu_, std::try_to_lock);
      if (!g.owns_lock()) {
        ts = PyEval_SaveThread();  // the progress thread holds it briefly
        g.lock();
      }
      dirty_[pe] = 1;
      req = send_nb(pe, h, data, n);
    }
    int outcome = 0;  // 0 ok, 1 send error, 2 peer gone, 3 timeout
    if (req != nullptr) {
      if (ts == nullptr) ts = PyEval_SaveThread();
      outcome = wait_req(req, pe, send_timeout_s_);
    }
    if (ts != nullptr) PyEval_RestoreThread(ts);
    if (outcome == 0 || group_->remote_state(pe) == kStateClosed) return;
    const char* why = nullptr;
    if (group_->check(pe, &why) >= 0) throw_peer(fn, pe, why);
    if (outcome == 3) {
      WaitResult r{kWaitTimeout, 0, -1, nullptr};
      PyObject* what = PyUnicode_FromString(fn);
      raise_wait_error(r, send_timeout_s_, what, false);
      Py_XDECREF(what);
      throw py::error_already_set();
    }
    throw std::runtime_error(std::string(fn) + ": sending to PE " + std::to_string(pe) + " failed: " + last_error_);
  }

  // Waits for a send request without holding the lock between progress
  // calls (GIL released by the caller). 0 done, 1 error, 2 peer gone, 3 timeout.
  int wait_req(void* req, int pe, double timeout_s) {
    if (req == reinterpret_cast<void*>(-1)) return 1;
    const auto deadline = Clock::now() + std::chrono::nanoseconds(static_cast<int64_t>(timeout_s * 1e9));
    struct Polling {  // this thread progresses the engine meanwhile
      NetEngine* e;
      explicit Polling(NetEngine* e_) : e(e_) { e->poll_begin(); }
      ~Polling() { e->poll_end(false); }
    } polling(this);
    for (uint32_t i = 0;; ++i) {
      {
        std::lock_guard<std::mutex> g(mu_);
        ucs_status_t st = ucx.ucp_request_check_status(req);
        if (st != UCS_INPROGRESS) {
          ucx.ucp_request_free(req);
          return st == UCS_OK ? 0 : 1;
        }
        ucx.ucp_worker_progress(worker_);
        run_deferred();
      }
      const char* why = nullptr;
      int bad = (i & 63) == 0 ? group_->check(pe, &why) : -1;
      if (bad >= 0 || Clock::now() > deadline) {
        std::lock_guard<std::mutex> g(mu_);
        ucx.ucp_request_free(req);  // released by UCX when it ends (the endpoint's error ends it)
        return bad >= 0 ? 2 : 3;
      }
      if (i > 256) std::this_thread::yield();
    }
  }

  void ensure_alive(int pe, const char* fn) {
    const char* why = nullptr;
    if (group_->check(pe, &why) >= 0) throw_peer(fn, pe, why);
  }

  [[noreturn]] void throw_peer(const char* fn, int pe, const char* why) {
    WaitResult r{kWaitPeer, 0, pe, why};
    PyObject* what = PyUnicode_FromString(fn);
    raise_wait_error(r, 0, what);
    Py_XDECREF(what);
    throw py::error_already_set();
  }

  Pending* alloc_pending(int pe, void* dst, size_t cap, uint32_t* token) {
    std::lock_guard<std::mutex> g(pend_mu_);
    for (size_t i = 0; i < pending_.size(); ++i) {
      Pending& p = pending_[i];
      if (p.busy) continue;
      p.busy = true;
      p.gen = (p.gen + 1) & 0xffff;
      p.dst = dst;
      p.cap = cap;
      p.done.store(0, std::memory_order_relaxed);
      p.status = 0;
      p.value = 0;
      p.pe = pe;
      p.error[0] = 0;
      *token = static_cast<uint32_t>(i) | (p.gen << 16);
      return &p;
    }
    return nullptr;
  }
  void free_pending(Pending* p) {
    std::lock_guard<std::mutex> g(pend_mu_);
    p->busy = false;
    p->dst = nullptr;
  }
  Pending* lookup(uint32_t token) {
    std::lock_guard<std::mutex> g(pend_mu_);
    const size_t i = token & 0xffff;
    if (i >= pending_.size()) return nullptr;
    Pending& p = pending_[i];
    if (!p.busy || p.gen != (token >> 16)) return nullptr;  // stale: its request gave up
    return &p;
  }

  Pending* request(int pe, Hdr& h, const void* data, size_t n, void* dst, size_t cap, double timeout_s,
                   const char* fn) {
    WaitResult r{kWaitOk, 0, -1, nullptr};
    Pending* p = request_nothrow(pe, h, data, n, dst, cap, timeout_s, &r);
    if (p != nullptr) {
      if (p->status != kReplyOk) {
        std::string err = std::string(fn) + ": PE " + std::to_string(pe) + " rejected the request: " + p->error;
        free_pending(p);
        throw std::invalid_argument(err);
      }
      return p;
    }
    if (r.status == kWaitInterrupted) throw py::error_already_set();
    PyObject* what = PyUnicode_FromString(fn);
    raise_wait_error(r, timeout_s, what, false);
    Py_XDECREF(what);
    throw py::error_already_set();
  }

  // Sends a request and waits for its reply. On failure returns nullptr with
  // *res set (timeout, peer failure, interrupted).
  Pending* request_nothrow(int pe, Hdr& h, const void* data, size_t n, void* dst, size_t cap, double timeout_s,
                           WaitResult* res) {
    const char* why = nullptr;
    if (group_->check(pe, &why) >= 0) {
      *res = {kWaitPeer, 0, pe, why};
      return nullptr;
    }
    uint32_t token = 0;
    Pending* p = alloc_pending(pe, dst, cap, &token);
    if (p == nullptr) {
      *res = {kWaitTimeout, 0, -1, nullptr};
      return nullptr;
    }
    h.token = token;
    PyThreadState* ts = PyEval_SaveThread();
    void* req;
    {
      std::lock_guard<std::mutex> g(mu_);
      dirty_[pe] = 1;
      req = send_nb(pe, h, data, n);
    }
    const bool sent_ok = req == nullptr || wait_req(req, pe, std::max(timeout_s, 0.0) + 1.0) == 0;
    const auto start = Clock::now();
    const int64_t timeout_ns = timeout_s <= 0 ? 0 : static_cast<int64_t>(std::min(timeout_s, 1e9) * 1e9);
    const int64_t spin_ns = std::min(spin_budget_ns(), timeout_ns);
    int outcome = 0;  // 1 ok, 2 timeout, 3 peer
    bool polling = true;
    poll_begin();
    while (outcome == 0) {
      if (p->done.load(std::memory_order_acquire)) { outcome = 1; break; }
      const int64_t e = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
      if (!sent_ok || group_->check(pe, &why) >= 0) {
        if (p->done.load(std::memory_order_acquire)) { outcome = 1; break; }
        outcome = 3;
        if (why == nullptr) why = "could not be reached";
        break;
      }
      if (e >= timeout_ns) { outcome = 2; break; }
      if (e < spin_ns) {
        poll();
        continue;
      }
      if (polling) {
        polling = false;
        poll_end(true);
      }
      std::unique_lock<std::mutex> lk(cv_mu_);
      cv_.wait_for(lk, std::chrono::milliseconds(2), [&] { return p->done.load(std::memory_order_acquire) != 0; });
    }
    if (polling) poll_end(false);
    PyEval_RestoreThread(ts);
    if (outcome == 1) {
      std::atomic_thread_fence(std::memory_order_acquire);
      return p;
    }
    free_pending(p);  // a late reply finds the slot's generation changed and is dropped
    *res = outcome == 2 ? WaitResult{kWaitTimeout, 0, -1, nullptr} : WaitResult{kWaitPeer, 0, pe, why};
    return nullptr;
  }

  void complete(Pending* p) {
    p->done.store(1, std::memory_order_release);
    std::lock_guard<std::mutex> lk(cv_mu_);
    cv_.notify_all();
  }

  // ---------------------------------------------------------------- receiving (mu_ held)
  static ucs_status_t on_am(void* arg, const void* header, size_t header_length, void* data, size_t length,
                            const ucp_am_recv_param_t* param) {
    auto* self = static_cast<NetEngine*>(arg);
    if (header_length != sizeof(Hdr)) {
      ++self->bad_;
      return UCS_OK;
    }
    Hdr h;
    std::memcpy(&h, header, sizeof h);
    const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    const ucp_ep_h via = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 ? param->reply_ep : nullptr;
    return self->handle(h, data, length, rndv, via);
  }

  static void on_ep_error(void* arg, ucp_ep_h ep, ucs_status_t) {
    auto* self = static_cast<NetEngine*>(arg);
    for (int pe = 0; pe < self->world_; ++pe)
      if (self->eps_[pe] == ep) self->mark(pe, kStateDead);
  }

  void mark(int pe, uint32_t state) {
    if (debug_)
      fprintf(stderr, "[asap net] PE %d: PE %d -> %s (was %u)\n", rank_, pe, state == kStateClosed ? "closed" : "dead",
              group_->remote_state(pe));
    group_->set_remote_state(pe, state);
    std::lock_guard<std::mutex> lk(cv_mu_);
    cv_.notify_all();
  }

  void reply(int pe, const Hdr& req, int32_t status, uint64_t value, const char* data, size_t n) {
    Deferred d;
    d.pe = pe;
    d.h = Hdr{};
    d.h.kind = kReply;
    d.h.src = static_cast<uint32_t>(rank_);
    d.h.token = req.token;
    d.h.status = status;
    d.h.value = value;
    d.data = data;
    d.n = n;
    deferred_.push_back(d);
  }

  ucs_status_t handle(Hdr& h, void* data, size_t length, bool rndv, ucp_ep_h via) {
    ++received_;
    const int src = static_cast<int>(h.src);
    // The endpoint must be the one opened to the PE the header names: a message from any other endpoint
    // (a process outside the group, or a member claiming another's rank) is dropped unread.
    if (src < 0 || src >= world_ || eps_[src] == nullptr || via != eps_[src]) {
      ++unauth_;
      last_error_ = "dropped a message from an endpoint that is not the named sender's";
      return UCS_OK;
    }
    if (h.seq != rx_seq_[src]) ++disorder_;  // the named sender's own endpoint: its sequence counts
    rx_seq_[src] = h.seq + 1;
    if (h.kind == kHello || h.kind == kHelloAck) {
      if (rndv || length != kHandshakeBytes) {
        ++unauth_;
        return UCS_OK;
      }
      std::lock_guard<std::mutex> g(hs_mu_);
      if (handshakes_.size() < 4 * static_cast<size_t>(world_))
        handshakes_.push_back({src, h.kind, std::string(static_cast<const char*>(data), length)});
      return UCS_OK;
    }
    if (!authed_[src]) {  // the peer has not answered this PE's challenge (yet): nothing of it is applied
      ++unauth_;
      last_error_ = "dropped a message from PE " + std::to_string(src) + " before it authenticated";
      return UCS_OK;
    }
    switch (h.kind) {
      case kHeartbeat: return UCS_OK;
      case kClose:
        group_->set_remote_done(src, h.value);  // before the state: a waiter that sees "closed" sees this too
        mark(src, kStateClosed);
        reply(src, h, kReplyOk, 0, nullptr, 0);
        return UCS_OK;
      case kReply: return on_reply(h, data, length, rndv);
      case kQuiet: reply(src, h, kReplyOk, 0, nullptr, 0); return UCS_OK;
      case kSignal:
      case kSignalFetch: {
        char* s = resolve(h.sig_region, h.sig_off, 8);
        if (s == nullptr || (h.sig_off & 7) != 0 || h.op > 1) {
          ++bad_;
          if (h.kind == kSignalFetch) reply(src, h, kReplyBad, 0, nullptr, 0);
          return UCS_OK;
        }
        const uint64_t old = signal_update(reinterpret_cast<uint64_t*>(s), h.value, static_cast<int>(h.op), own_);
        if (h.kind == kSignalFetch) reply(src, h, kReplyOk, old, nullptr, 0);
        return UCS_OK;
      }
      case kGet: {
        char* p = resolve(h.region, h.off, h.nbytes);
        if (p == nullptr) {
          ++bad_;
          reply(src, h, kReplyBad, 0, nullptr, 0);
          return UCS_OK;
        }
        reply(src, h, kReplyOk, 0, p, h.nbytes);
        return UCS_OK;
      }
      case kPut:
      case kPutSignal: {
        char* dst = resolve(h.region, h.off, h.nbytes);
        char* sig = h.kind == kPutSignal ? resolve(h.sig_region, h.sig_off, 8) : nullptr;
        if (dst == nullptr || length != h.nbytes || (h.kind == kPutSignal && (sig == nullptr || (h.sig_off & 7)))) {
          ++bad_;
          last_error_ = std::string("dropped a ") + kind_name(h.kind) + " from PE " + std::to_string(src) +
                        ": range out of bounds";
          return UCS_OK;
        }
        if (!rndv) {
          if (length) std::memcpy(dst, data, length);
          finish_put(h);
          return UCS_OK;
        }
        return recv_rndv(h, data, dst, length);
      }
      case kMbox: {
        char* base = resolve(h.region, h.off, 0);
        const bool fits = base != nullptr && h.nslots > 0 && h.slot_bytes >= h.nbytes && h.ndim <= kMaxDims &&
                          resolve(h.region, h.off, mailbox_bytes(h.slot_bytes, h.nslots)) != nullptr &&
                          length == h.nbytes && (h.off & 63) == 0;
        if (!fits) {
          ++bad_;
          reply(src, h, kReplyBad, 0, nullptr, 0);
          return UCS_OK;
        }
        if (!rndv) {
          deliver_mbox(h, data);
          return UCS_OK;
        }
        return recv_rndv(h, data, nullptr, length);
      }
      default: ++bad_; return UCS_OK;
    }
  }

  void finish_put(const Hdr& h) {
    if (h.kind == kPutSignal) {
      char* sig = resolve(h.sig_region, h.sig_off, 8);
      signal_update(reinterpret_cast<uint64_t*>(sig), h.value, static_cast<int>(h.op), own_);
    }
  }

  void deliver_mbox(const Hdr& h, const void* payload) {
    const uintptr_t base = reinterpret_cast<uintptr_t>(resolve(h.region, h.off, 0));
    WaitResult r = ring_try_send(base, h.nslots, h.slot_bytes, own_, h.src, h.tag, h.dtype, static_cast<int>(h.ndim),
                                 h.dims, payload, h.nbytes);
    reply(static_cast<int>(h.src), h, r.status == kWaitOk ? kReplyOk : kReplyFull, r.value, nullptr, 0);
  }

  ucs_status_t recv_rndv(const Hdr& h, void* desc, char* dst, size_t length) {
    auto* c = new RndvCtx{this, h, {}};
    if (dst == nullptr) {
      c->tmp.resize(length);
      dst = c->tmp.data();
    }
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.recv_am = &NetEngine::on_rndv_done;
    rp.user_data = c;
    void* req = ucx.ucp_am_recv_data_nbx(worker_, desc, dst, length, &rp);
    if (req == nullptr) {
      rndv_finished(c, UCS_OK);
    } else if (UCS_PTR_IS_ERR(req)) {
      rndv_finished(c, UCS_PTR_STATUS(req));
    }
    return UCS_INPROGRESS;
  }

  static void on_rndv_done(void* req, ucs_status_t st, size_t, void* user) {
    auto* c = static_cast<RndvCtx*>(user);
    c->eng->rndv_finished(c, st);
    ucx.ucp_request_free(req);
  }

  void rndv_finished(RndvCtx* c, ucs_status_t st) {
    const Hdr& h = c->h;
    if (st != UCS_OK) {
      last_error_ = ucs_err("receiving a rendezvous message", st);
      if (h.kind == kMbox) reply(static_cast<int>(h.src), h, kReplyFull, 0, nullptr, 0);
    } else if (h.kind == kMbox) {
      deliver_mbox(h, c->tmp.data());
    } else if (h.kind == kReply) {
      Pending* p = lookup(h.token);
      if (p != nullptr) complete(p);
    } else {
      finish_put(h);
    }
    delete c;
  }

  ucs_status_t on_reply(const Hdr& h, void* data, size_t length, bool rndv) {
    Pending* p = lookup(h.token);
    if (p == nullptr) return UCS_OK;  // its requester gave up
    p->status = h.status;
    p->value = h.value;
    if (length > 0 && h.status == kReplyOk) {
      if (p->dst == nullptr || length > p->cap) {
        p->status = kReplyBad;
        snprintf(p->error, sizeof p->error, "reply of %zu bytes does not fit %zu", length, p->cap);
        if (rndv) return UCS_OK;  // drops the descriptor
      } else if (rndv) {
        return recv_rndv(h, data, static_cast<char*>(p->dst), length);
      } else {
        std::memcpy(p->dst, data, length);
      }
    }
    if (h.status == kReplyBad && p->error[0] == 0) snprintf(p->error, sizeof p->error, "%s", "out of bounds");
    complete(p);
    return UCS_OK;
  }

  struct Deferred {
    int pe;
    Hdr h;
    const char* data = nullptr;
    size_t n = 0;
  };

  // Sends the replies the handlers queued (mu_ held; not from a callback).
  void run_deferred() {
    while (!deferred_.empty()) {
      Deferred d = deferred_.front();
      deferred_.pop_front();
      if (eps_[d.pe] == nullptr || group_->remote_state(d.pe) == kStateDead) continue;
      void* req = send_nb(d.pe, d.h, d.data, d.n);
      // Nobody waits for a reply's completion: UCX frees the request when it
      // ends. The data it reads (a get's range) lives in a registered region.
      if (req != nullptr && req != reinterpret_cast<void*>(-1)) ucx.ucp_request_free(req);
    }
  }

  // Reads PE `pe`'s liveness line (mu_ held; non-blocking): its goodbye marks the PE closed (with the
  // barrier round it completed), an end without one or an error marks it dead. Then the line is closed.
  void check_line(int pe) {
    const int fd = lines_[pe];
    if (fd < 0) return;
    std::string& buf = line_buf_[pe];
    const char* verdict = nullptr;
    for (;;) {
      char tmp[16];
      const ssize_t n = ::read(fd, tmp, sizeof tmp);
      if (n > 0) {
        buf.append(tmp, static_cast<size_t>(n));
        if (buf.size() > 64) buf.erase(0, buf.size() - 64);
        continue;
      }
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) verdict = errno == ETIMEDOUT ? "its host stopped answering (host or link lost)" : std::strerror(errno);
      else verdict = "its liveness line closed";
      break;
    }
    if (buf.size() >= kByeBytes && buf[0] == 'B') {
      uint64_t done = 0;
      std::memcpy(&done, buf.data() + 1, sizeof done);
      group_->set_remote_done(pe, done);
      mark(pe, kStateClosed);
      verdict = verdict != nullptr ? verdict : "said goodbye";
    } else if (verdict != nullptr && group_->remote_state(pe) == kStateAlive) {
      last_error_ = "PE " + std::to_string(pe) + ": " + verdict;
      mark(pe, kStateDead);
    }
    if (verdict != nullptr) drop_line(pe);
  }

  void drop_line(int pe) {
    if (lines_[pe] < 0) return;
    if (line_epoll_ >= 0) epoll_ctl(line_epoll_, EPOLL_CTL_DEL, lines_[pe], nullptr);
    ::close(lines_[pe]);
    lines_[pe] = -1;
  }

  // The lines, every 100 ms from whichever thread progresses (mu_ held): a backstop for the progress
  // thread's epoll, which wakes on them at once.
  void tick() {
    for (int pe = 0; pe < world_; ++pe) check_line(pe);
  }

  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
  }

  // Heart-beats and the peer timeout, every 100 ms, from whichever thread
  // progresses (mu_ held).
  void maybe_tick() {
    const auto now = Clock::now();
    if (now - last_tick_ > std::chrono::milliseconds(100)) {
      last_tick_ = now;
      tick();
    }
  }

  void unpark() {
    std::lock_guard<std::mutex> lk(park_mu_);
    park_cv_.notify_all();
  }

  // The progress thread. While a thread of this PE polls the engine (a
  // wait's spin phase), or did so less than kParkGraceNs ago, it stays
  // parked and leaves the messages to that thread; otherwise it sleeps on
  // the worker's event descriptor and progresses whatever arrives. A poller
  // that goes to sleep hands over at once (poll_end(true)); one whose wait
  // was satisfied hands over after the grace period at the latest, which
  // bounds how long a message to a busy PE (one computing, not waiting)
  // waits for its answer.
  void progress_loop() {
    constexpr int64_t kParkGraceNs = 200 * 1000;
    // A low priority (nice 19, $ASAP_NET_PROGRESS_NICE): when it wakes it does not preempt this host's
    // spinning waiters, whose progress matters more (measured: one-way ping-pong 13.5 us at nice 19,
    // 15-20 us at nice 0, across two namespaces on 2 cores). It needs microseconds per wake-up, which
    // CFS grants at any nice level well within the peer timeout.
    const char* nv = std::getenv("ASAP_NET_PROGRESS_NICE");
    setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), nv != nullptr ? std::atoi(nv) : 19);
    int ep = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ev {};
    ev.events = EPOLLIN;
    ev.data.u32 = 0;  // the worker
    epoll_ctl(ep, EPOLL_CTL_ADD, efd_, &ev);
    {
      std::lock_guard<std::mutex> g(mu_);
      for (int pe = 0; pe < world_; ++pe) {
        if (lines_[pe] < 0) continue;
        struct epoll_event le {};
        le.events = EPOLLIN | EPOLLRDHUP;
        le.data.u32 = static_cast<uint32_t>(pe) + 1;  // PE pe's liveness line
        epoll_ctl(ep, EPOLL_CTL_ADD, lines_[pe], &le);
      }
      line_epoll_ = ep;
    }
    for (;;) {
      const int64_t idle = now_ns() - last_poll_ns_.load(std::memory_order_relaxed);
      if (pollers_.load(std::memory_order_acquire) > 0 || idle < kParkGraceNs) {
        {
          std::lock_guard<std::mutex> g(mu_);
          if (stop_) break;
          maybe_tick();
        }
        std::unique_lock<std::mutex> lk(park_mu_);
        park_cv_.wait_for(lk, std::chrono::nanoseconds(std::max<int64_t>(kParkGraceNs - std::max<int64_t>(idle, 0),
                                                                           20 * 1000)));
        ++parks_;
        continue;
      }
      ucs_status_t armed;
      {
        std::lock_guard<std::mutex> g(mu_);
        if (stop_) break;
        while (ucx.ucp_worker_progress(worker_) != 0) {
        }
        run_deferred();
        maybe_tick();
        armed = ucx.ucp_worker_arm(worker_);
      }
      if (armed == UCS_ERR_BUSY) continue;
      struct epoll_event out[8];
      const int n = epoll_wait(ep, out, 8, 100);
      ++wakeups_;
      for (int i = 0; i < n; ++i) {
        if (out[i].data.u32 == 0) continue;
        std::lock_guard<std::mutex> g(mu_);
        check_line(static_cast<int>(out[i].data.u32) - 1);
      }
    }
    {
      std::lock_guard<std::mutex> g(mu_);
      line_epoll_ = -1;
    }
    close(ep);
  }

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
  uint64_t disorder_ = 0, bad_ = 0, received_ = 0, sent_ = 0, wakeups_ = 0, unauth_ = 0;
  std::vector<uint8_t> authed_ = std::vector<uint8_t>(world_, 0);  // the peer answered this PE's challenge
  struct Handshake {
    int pe;
    uint32_t kind;
    std::string payload;
  };
  std::mutex hs_mu_;
  std::vector<Handshake> handshakes_;  // received, for Python to answer or check
  std::string last_error_;
};

CtrlSpan ctrl_word_span(const char* fn, int64_t word) {
  CtrlSpan s;
  if (!ctrl_span(word, &s)) throw py::value_error(std::string("_C.NetEngine.") + fn + ": unknown control word " + std::to_string(word));
  return s;
}

}  // namespace

void bind_net(py::module& m) {
  m.attr("NET_AVAILABLE") = true;
  m.def("net_load", &load_ucx, py::arg("ucp_path"), py::arg("ucs_path"),
        "Load UCX's libraries (paths of libucp.so and libucs.so) once per process.");
  py::class_<NetEngine>(m, "NetEngine")
      .def(py::init([](Group& g, uintptr_t own_ctrl, double peer_timeout_s, const std::string& tls) {
             auto* e = new NetEngine(&g, own_ctrl, peer_timeout_s, tls);
             g.set_net(e);
             return e;
           }),
           py::arg("group"), py::arg("own_ctrl"), py::arg("peer_timeout_s"), py::arg("tls"), py::keep_alive<1, 2>())
      .def("address", &NetEngine::address)
      .def("connect", &NetEngine::connect, py::arg("pe"), py::arg("address"))
      .def("start", &NetEngine::start)
      .def("handshake_send", &NetEngine::handshake_send, py::arg("pe"), py::arg("answer"), py::arg("payload"))
      .def("take_handshakes", &NetEngine::take_handshakes)
      .def("authenticate", &NetEngine::authenticate, py::arg("pe"))
      .def("watch", &NetEngine::watch, py::arg("pe"), py::arg("fd"))
      .def("add_region",
           [](NetEngine& e, uint32_t index, const Mapping& mp) { e.add_region(index, mp.addr(), mp.size()); },
           py::arg("index"), py::arg("mapping"), "Region `index` (1 + heap chunk) is this mapping.")
      // The user's side of a put or get is a tensor and a byte range of it (never an address).
      .def("put",
           [](NetEngine& e, int pe, uint32_t region, uint64_t off, py::handle src, uint64_t src_off, uint64_t nbytes) {
             uintptr_t p;
             if (!tensor_span(src.ptr(), "put", "src", src_off, nbytes, &p)) throw py::error_already_set();
             e.put(pe, region, off, p, nbytes);
           },
           py::arg("pe"), py::arg("region"), py::arg("off"), py::arg("src"), py::arg("src_off"), py::arg("nbytes"))
      .def("signal", &NetEngine::signal, py::arg("pe"), py::arg("region"), py::arg("off"), py::arg("value"),
           py::arg("op"), py::arg("fetch"), py::arg("timeout_s"))
      .def("get",
           [](NetEngine& e, int pe, uint32_t region, uint64_t off, py::handle dst, uint64_t dst_off, uint64_t nbytes,
              double timeout_s) {
             uintptr_t p;
             if (!tensor_span(dst.ptr(), "get", "dst", dst_off, nbytes, &p)) throw py::error_already_set();
             e.get(pe, region, off, p, nbytes, timeout_s);
           },
           py::arg("pe"), py::arg("region"), py::arg("off"), py::arg("dst"), py::arg("dst_off"), py::arg("nbytes"),
           py::arg("timeout_s"))
      // The control block by word id (kernels/ctrl.hpp): Python never adds its offsets.
      .def("signal_ctrl",
           [](NetEngine& e, int pe, int64_t word, uint64_t value, int op, bool fetch, double timeout_s) {
             return e.signal(pe, 0, ctrl_word_span("signal_ctrl", word).off, value, op, fetch, timeout_s);
           },
           py::arg("pe"), py::arg("word"), py::arg("value"), py::arg("op"), py::arg("fetch"), py::arg("timeout_s"))
      .def("get_ctrl",
           [](NetEngine& e, int pe, int64_t word, py::handle dst, double timeout_s) {
             const CtrlSpan s = ctrl_word_span("get_ctrl", word);
             uintptr_t p;
             if (!tensor_span(dst.ptr(), "get", "dst", 0, s.nbytes, &p)) throw py::error_already_set();
             e.get(pe, 0, s.off, p, s.nbytes, timeout_s);
           },
           py::arg("pe"), py::arg("word"), py::arg("dst"), py::arg("timeout_s"))
      .def("quiet", &NetEngine::quiet, py::arg("timeout_s"))
      .def("poll", &NetEngine::poll)
      .def("stats", &NetEngine::stats)
      .def("shutdown", &NetEngine::shutdown, py::call_guard<py::gil_scoped_release>());
}

}  // namespace asap

#else  // !ASAP_HAVE_UCX

namespace py = pybind11;
namespace asap {
void bind_net(py::module& m) { m.attr("NET_AVAILABLE") = false; }
}  // namespace asap

#endif
