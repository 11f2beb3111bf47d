// The network engine: sending, and requests that await their reply (kernels/net_engine.hpp).
#ifdef ASAP_HAVE_UCX
#include "net_engine.hpp"

#include <cstring>
#include <stdexcept>
#include "handles.hpp"

namespace asap::net {

// Issues one send (mu_ held). Returns the UCX request, or nullptr when done.
void* NetEngine::send_nb(int pe, Hdr& h, const void* data, size_t n) {
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
bool NetEngine::wait_req_locked(void* req, double timeout_s) {
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
void NetEngine::send_blocking(int pe, Hdr& h, const void* data, size_t n, const char* fn) {
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
    throw PythonError{};
  }
  throw std::runtime_error(std::string(fn) + ": sending to PE " + std::to_string(pe) + " failed: " + last_error_);
}

// Waits for a send request without holding the lock between progress
// calls (GIL released by the caller). 0 done, 1 error, 2 peer gone, 3 timeout.
int NetEngine::wait_req(void* req, int pe, double timeout_s) {
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

void NetEngine::ensure_alive(int pe, const char* fn) {
  const char* why = nullptr;
  if (group_->check(pe, &why) >= 0) throw_peer(fn, pe, why);
}

void NetEngine::throw_peer(const char* fn, int pe, const char* why) {
  WaitResult r{kWaitPeer, 0, pe, why};
  PyObject* what = PyUnicode_FromString(fn);
  raise_wait_error(r, 0, what);
  Py_XDECREF(what);
  throw PythonError{};
}

Pending* NetEngine::alloc_pending(int pe, void* dst, size_t cap, uint32_t* token) {
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

void NetEngine::free_pending(Pending* p) {
  std::lock_guard<std::mutex> g(pend_mu_);
  p->busy = false;
  p->dst = nullptr;
}

Pending* NetEngine::lookup(uint32_t token) {
  std::lock_guard<std::mutex> g(pend_mu_);
  const size_t i = token & 0xffff;
  if (i >= pending_.size()) return nullptr;
  Pending& p = pending_[i];
  if (!p.busy || p.gen != (token >> 16)) return nullptr;  // stale: its request gave up
  return &p;
}

Pending* NetEngine::request(int pe, Hdr& h, const void* data, size_t n, void* dst, size_t cap, double timeout_s,
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
  if (r.status == kWaitInterrupted) throw PythonError{};
  PyObject* what = PyUnicode_FromString(fn);
  raise_wait_error(r, timeout_s, what, false);
  Py_XDECREF(what);
  throw PythonError{};
}

// Sends a request and waits for its reply. On failure returns nullptr with
// *res set (timeout, peer failure, interrupted). A request whose send or reply
// took longer than `timeout_s` while the peer lives times out (the peer may be
// stopped: its liveness line stands); only a peer that died or closed is a peer
// failure. `keep_unanswered`: such a request's slot is returned (with
// res->status kWaitTimeout) instead of freed, so that a late reply still lands.
Pending* NetEngine::request_nothrow(int pe, Hdr& h, const void* data, size_t n, void* dst, size_t cap, double timeout_s,
                         WaitResult* res, bool keep_unanswered) {
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
  // 0 sent, 1 send error, 2 peer gone, 3 still sending (a stopped peer's window is full): it may yet arrive
  const int sent = req == nullptr ? 0 : wait_req(req, pe, std::max(timeout_s, 0.0) + 1.0);
  int outcome;  // 1 answered, 2 timeout, 3 peer
  if (sent == 1 || sent == 2) {
    outcome = 3;
    if (group_->check(pe, &why) < 0) why = "could not be reached";
  } else {
    outcome = await_reply(p, pe, sent == 3 ? 0.0 : timeout_s, &why);
  }
  PyEval_RestoreThread(ts);
  if (outcome == 1) {
    std::atomic_thread_fence(std::memory_order_acquire);
    return p;
  }
  if (outcome == 2 && keep_unanswered) {
    *res = {kWaitTimeout, 0, -1, nullptr};
    return p;
  }
  free_pending(p);  // a late reply finds the slot's generation changed and is dropped
  *res = outcome == 2 ? WaitResult{kWaitTimeout, 0, -1, nullptr} : WaitResult{kWaitPeer, 0, pe, why};
  return nullptr;
}

int NetEngine::await_reply(Pending* p, int pe, double timeout_s, const char** why) {
  const auto start = Clock::now();
  const int64_t timeout_ns = timeout_s <= 0 ? 0 : static_cast<int64_t>(std::min(timeout_s, 1e9) * 1e9);
  const int64_t spin_ns = std::min(spin_budget_ns(), timeout_ns);
  int outcome = 0;  // 1 ok, 2 timeout, 3 peer
  bool polling = true;
  poll_begin();
  while (outcome == 0) {
    if (p->done.load(std::memory_order_acquire)) { outcome = 1; break; }
    const int64_t e = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
    if (group_->check(pe, why) >= 0) {
      outcome = p->done.load(std::memory_order_acquire) ? 1 : 3;
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
  return outcome;
}

void NetEngine::complete(Pending* p) {
  p->done.store(1, std::memory_order_release);
  std::lock_guard<std::mutex> lk(cv_mu_);
  cv_.notify_all();
}

}  // namespace asap::net
#endif  // ASAP_HAVE_UCX
