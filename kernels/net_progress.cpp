// The network engine: polling and the progress thread (kernels/net_engine.hpp).
#ifdef ASAP_HAVE_UCX
#include "net_engine.hpp"

#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>

namespace asap::net {

// Starts the progress thread (after every connect).
void NetEngine::start() {
  std::lock_guard<std::mutex> g(mu_);
  if (thread_.joinable()) return;
  stop_ = false;
  thread_ = std::thread([this] { progress_loop(); });
}

void NetEngine::poll() {
  std::unique_lock<std::mutex> g(mu_, std::try_to_lock);
  if (!g.owns_lock() || worker_ == nullptr) return;
  while (ucx.ucp_worker_progress(worker_) != 0) {
  }
  run_deferred();
  maybe_tick();
}


void NetEngine::poll_end(bool sleeping) {
  // going to sleep: no grace period, the progress thread takes over now
  last_poll_ns_.store(sleeping ? 0 : now_ns(), std::memory_order_relaxed);
  if (pollers_.fetch_sub(1, std::memory_order_acq_rel) == 1 && sleeping) unpark();
}

int64_t NetEngine::now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

// Heart-beats and the peer timeout, every 100 ms, from whichever thread
// progresses (mu_ held).
void NetEngine::maybe_tick() {
  const auto now = Clock::now();
  if (now - last_tick_ > std::chrono::milliseconds(100)) {
    last_tick_ = now;
    tick();
  }
}

void NetEngine::unpark() {
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
void NetEngine::progress_loop() {
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

}  // namespace asap::net
#endif  // ASAP_HAVE_UCX
