// The network engine: set-up, the operations Python calls, stats and shutdown (kernels/net_engine.hpp).
#ifdef ASAP_HAVE_UCX
#include "net_engine.hpp"

#include <cstring>
#include <stdexcept>
#include "ctrl.hpp"
#include "handles.hpp"

namespace asap::net {

NetEngine::NetEngine(Group* group, uintptr_t own_ctrl, double peer_timeout_s, const std::string& tls)
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

// ---------------------------------------------------------------- set-up
std::string NetEngine::address() {
  std::lock_guard<std::mutex> g(mu_);
  ucp_worker_attr_t attr{};
  attr.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS;
  ucs_status_t st = ucx.ucp_worker_query(worker_, &attr);
  if (st != UCS_OK) throw std::runtime_error(ucs_err("ucp_worker_query", st));
  std::string out(reinterpret_cast<const char*>(attr.address), attr.address_length);
  ucx.ucp_worker_release_address(worker_, attr.address);
  return out;
}

void NetEngine::connect(int pe, const std::string& addr) {
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

// ---------------------------------------------------------------- authentication (set-up, before start)
// Sends PE `pe` a handshake message (a challenge or an answer: 32 bytes).
void NetEngine::handshake_send(int pe, bool answer, const std::string& payload) {
  if (payload.size() != kHandshakeBytes)
    throw std::invalid_argument("net: handshake: the payload must be " + std::to_string(kHandshakeBytes) + " bytes");
  Hdr h = make(answer ? kHelloAck : kHello, pe);
  h.nbytes = payload.size();
  send_blocking(pe, h, payload.data(), payload.size(), answer ? "handshake answer" : "handshake challenge");
}

// The handshake messages received since the last call: [(pe, "challenge"|"answer", payload)].
std::vector<NetEngine::Handshake> NetEngine::take_handshakes() {
  std::vector<Handshake> got;
  std::lock_guard<std::mutex> g(hs_mu_);
  got.swap(handshakes_);
  return got;
}

// PE `pe` answered this PE's challenge correctly: from now on its messages are applied.
void NetEngine::authenticate(int pe) {
  check_pe("authenticate", pe);
  std::lock_guard<std::mutex> g(mu_);
  if (eps_[pe] == nullptr) throw std::invalid_argument("net: authenticate: PE " + std::to_string(pe) + " is not connected");
  authed_[pe] = 1;
}

void NetEngine::fence(int pe) {
  check_pe("fence", pe);
  std::lock_guard<std::mutex> g(mu_);
  if (pe == rank_ || eps_[pe] == nullptr)
    throw std::invalid_argument("net: fence: PE " + std::to_string(pe) + " is not a remote peer of PE " +
                                std::to_string(rank_));
  if (group_->remote_state(pe) != kStateAlive) return;
  last_error_ = "PE " + std::to_string(pe) + ": declared dead by the group (fenced)";
  mark(pe, kStateDead);  // its liveness line stays open: the PE is not told (its own lines tell it when it is cut off)
}

void NetEngine::add_region(uint32_t index, uintptr_t base, size_t size) {
  std::lock_guard<std::mutex> g(mu_);
  if (index != regions_.size())
    throw std::runtime_error("net: add_region: region " + std::to_string(index) + " out of order (have " +
                             std::to_string(regions_.size()) + ")");
  regions_.push_back({reinterpret_cast<char*>(base), size});
}

// ---------------------------------------------------------------- operations (GIL held on entry)
void NetEngine::put(int pe, uint32_t region, uint64_t off, uintptr_t src, uint64_t nbytes) {
  Hdr h = make(kPut, pe);
  h.region = region;
  h.off = off;
  h.nbytes = nbytes;
  send_blocking(pe, h, reinterpret_cast<const void*>(src), nbytes, "put");
}

void NetEngine::put_signal(int pe, uint32_t region, uint64_t off, uintptr_t src, uint64_t nbytes, uint32_t sig_region,
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

bool NetEngine::put_signal_py(int pe, uint32_t region, uint64_t off, uintptr_t src, uint64_t nbytes, uint32_t sig_region,
                   uint64_t sig_off, uint64_t value, int op) {
  try {
    put_signal(pe, region, off, src, nbytes, sig_region, sig_off, value, op);
    return true;
  } catch (const PythonError&) {
    // set already
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return false;
}

// fetch: wait for the target's answer and return the previous value.
uint64_t NetEngine::signal(int pe, uint32_t region, uint64_t off, uint64_t value, int op, bool fetch, double timeout_s) {
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

void NetEngine::get(int pe, uint32_t region, uint64_t off, uintptr_t dst, uint64_t nbytes, double timeout_s) {
  Hdr h = make(kGet, pe);
  h.region = region;
  h.off = off;
  h.nbytes = nbytes;
  Pending* p = request(pe, h, nullptr, 0, reinterpret_cast<void*>(dst), nbytes, timeout_s, "get");
  free_pending(p);
}

// Completes every operation this PE issued to the named remote PEs (all
// when empty): their effects are visible at the targets on return.
void NetEngine::quiet(double timeout_s) {
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
      if (r.status == kWaitInterrupted) throw PythonError{};
      PyObject* what = PyUnicode_FromString("quiet");
      raise_wait_error(r, timeout_s, what, false);
      Py_XDECREF(what);
      throw PythonError{};
    }
    dirty_[pe] = 0;
  }
}

// Whether an unanswered message is the one offered now (net_engine.hpp, Unanswered).
static bool same_message(const std::string& bytes, uintptr_t base_a, int64_t tag_a, uint32_t dtype_a, int ndim_a,
                         const int64_t* dims_a, uintptr_t base, int64_t tag, uint32_t dtype, int ndim,
                         const int64_t* dims, const void* payload, size_t nbytes) {
  if (base_a != base || tag_a != tag || dtype_a != dtype || ndim_a != ndim || bytes.size() != nbytes) return false;
  for (int i = 0; i < ndim; ++i)
    if (dims_a[i] != dims[i]) return false;
  return nbytes == 0 || std::memcmp(bytes.data(), payload, nbytes) == 0;
}

WaitResult NetEngine::mbox_send(int pe, uintptr_t local_base, size_t nslots, size_t slot_bytes, int64_t tag, uint32_t dtype,
                     int ndim, const int64_t* dims, const void* payload, size_t nbytes, double timeout_s) {
  uint32_t region = 0;
  uint64_t off = 0;
  if (!locate(local_base, mailbox_bytes(slot_bytes, nslots), &region, &off))
    return {kWaitPeer, 0, pe, "cannot be reached: the mailbox is not in a registered region"};
  const auto start = Clock::now();
  // The answer (placed, or full) is awaited past a short timeout, up to kAnswerS: a peer that answers within it
  // gets the message placed or refused in one call. One that does not (a stopped process) leaves the message
  // unanswered: the send raises TimeoutError, and offering the same message again awaits that same answer
  // (bounded by that call's timeout) rather than sending a copy.
  constexpr double kAnswerS = 1.0;
  Unanswered& u = unanswered_[pe];
  if (u.p != nullptr) {
    const bool same = same_message(u.bytes, u.base, u.tag, u.dtype, u.ndim, u.dims, local_base, tag, dtype, ndim, dims,
                                   payload, nbytes);
    Pending* p = u.p;
    if (!p->done.load(std::memory_order_acquire) && same) {
      const char* why = nullptr;
      PyThreadState* ts = PyEval_SaveThread();
      const int outcome = await_reply(p, pe, timeout_s, &why);
      PyEval_RestoreThread(ts);
      if (outcome == 2) return {kWaitTimeout, 0, -1, kUnanswered};  // still unanswered; still kept
      if (outcome == 3 && !p->done.load(std::memory_order_acquire)) {
        free_pending(p);
        u.p = nullptr;
        if (group_->remote_state(pe) == kStateClosed) return {kWaitOk, 0, -1, nullptr};  // dropped, as on one host
        return {kWaitPeer, 0, pe, why};
      }
    }
    u.p = nullptr;
    if (p->done.load(std::memory_order_acquire)) {
      std::atomic_thread_fence(std::memory_order_acquire);
      const int32_t status = p->status;
      const uint64_t pos = p->value;
      free_pending(p);
      if (same && status == kReplyOk) {  // the message offered again was placed by its first offer
        ++mbox_resumed_;
        return {kWaitOk, pos, -1, nullptr};
      }
      if (same) ++mbox_resumed_;  // refused (full): offered anew below
      else if (status == kReplyOk) ++mbox_abandoned_;  // placed after its sender gave up on it
    } else {
      free_pending(p);  // a different message: the unanswered one is abandoned (its late answer dropped)
      ++mbox_abandoned_;
    }
  }
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
    Pending* p = request_nothrow(pe, h, payload, nbytes, nullptr, 0, std::max(timeout_s - spent, kAnswerS), &r, true);
    if (p != nullptr && r.status == kWaitTimeout) {  // sent, not answered: kept for the same message's next offer
      u.p = p;
      u.base = local_base;
      u.tag = tag;
      u.dtype = dtype;
      u.ndim = ndim;
      for (int i = 0; i < ndim; ++i) u.dims[i] = dims[i];
      u.bytes.assign(static_cast<const char*>(payload), nbytes);
      ++mbox_unanswered_;
      return {kWaitTimeout, 0, -1, kUnanswered};
    }
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

NetStats NetEngine::stats() {
  std::lock_guard<std::mutex> g(mu_);
  NetStats d;
  d.disorder = disorder_;
  d.bad_messages = bad_;
  d.unauthenticated = unauth_;
  d.fenced = fenced_;
  d.received = received_;
  d.sent = sent_;
  d.mbox_unanswered = mbox_unanswered_;
  d.mbox_resumed = mbox_resumed_;
  d.mbox_abandoned = mbox_abandoned_;
  int lines = 0;
  for (int fd : lines_) lines += fd >= 0;
  d.liveness_lines = lines;
  d.progress_wakeups = wakeups_;
  d.progress_parks = parks_;
  d.last_error = last_error_;
  return d;
}

// Tells the remote PEs this one leaves, stops the progress thread, closes
// the endpoints and frees the worker. Idempotent.
void NetEngine::shutdown() {
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

void NetEngine::check_pe(const char* fn, int pe) const {
  if (pe < 0 || pe >= world_)
    throw std::invalid_argument(std::string("net: ") + fn + ": PE " + std::to_string(pe) + " out of range [0, " +
                                std::to_string(world_) + ")");
}

Hdr NetEngine::make(uint32_t kind, int pe) {
  check_pe(kind_name(kind), pe);
  if (eps_[pe] == nullptr)
    throw std::invalid_argument(std::string("net: ") + kind_name(kind) + ": PE " + std::to_string(pe) +
                                " is not a remote PE of this group");
  return header(kind);
}

// A header for this PE (no checks: the engine's own messages).
Hdr NetEngine::header(uint32_t kind) const {
  Hdr h{};
  h.kind = kind;
  h.src = static_cast<uint32_t>(rank_);
  return h;
}

bool NetEngine::locate(uintptr_t addr, size_t n, uint32_t* region, uint64_t* off) {
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
char* NetEngine::resolve(uint32_t region, uint64_t off, uint64_t n) const {
  if (region >= regions_.size()) return nullptr;
  const Region& r = regions_[region];
  if (off > r.size || n > r.size - off) return nullptr;
  return r.base + off;
}

}  // namespace asap::net
#endif  // ASAP_HAVE_UCX
