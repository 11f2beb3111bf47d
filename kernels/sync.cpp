// Liveness, futex wait/wake, signals, copies.
#include <Python.h>

#include <algorithm>
#include <cerrno>
#include <mutex>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "asap_shm.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define ASAP_CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define ASAP_CPU_RELAX() asm volatile("yield" ::: "memory")
#else
#define ASAP_CPU_RELAX() std::atomic_signal_fence(std::memory_order_seq_cst)
#endif

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

namespace asap {

namespace {

using Clock = std::chrono::steady_clock;

template <typename T>
inline std::atomic_ref<T> A(T& x) {
  return std::atomic_ref<T>(x);
}

int futex_wait(uint32_t* addr, uint32_t expected, int64_t ns) {
  struct timespec ts;
  ts.tv_sec = ns / 1000000000;
  ts.tv_nsec = ns % 1000000000;
  // Shared (not PRIVATE) futex: the word lives in a MAP_SHARED mapping.
  return static_cast<int>(syscall(SYS_futex, addr, FUTEX_WAIT, expected, &ts, nullptr, 0));
}

void futex_wake_all(uint32_t* addr) { syscall(SYS_futex, addr, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0); }

// Liveness of a pid without a pidfd: exists and is not a zombie.
bool pid_alive_procfs(int pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/stat", pid);
  FILE* f = fopen(path, "r");
  if (f == nullptr) return false;
  char buf[512];
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = 0;
  const char* rp = strrchr(buf, ')');  // comm may contain spaces or parens
  if (rp == nullptr || rp[1] == 0 || rp[2] == 0) return true;
  char state = rp[2];
  return state != 'Z' && state != 'X';
}

constexpr int64_t kSliceNs = 20 * 1000 * 1000;  // futex slice: liveness/deadline/signals
constexpr int64_t kPureSpinNs = 3000;            // spin without yielding for this long first

}  // namespace

int64_t spin_budget_ns() {
  static const int64_t v = [] {
    const char* s = std::getenv("ASAP_SPIN_NS");
    if (s == nullptr || *s == 0) return int64_t{50000};
    long long x = std::atoll(s);
    return static_cast<int64_t>(x < 0 ? 0 : x);
  }();
  return v;
}

namespace {
std::mutex g_groups_mu;
std::vector<const Group*> g_groups;  // live Groups (their handles reach native code as ints)
}  // namespace

bool check_group(const char* fn, uintptr_t handle) {
  {
    std::lock_guard<std::mutex> g(g_groups_mu);
    for (const Group* p : g_groups)
      if (reinterpret_cast<uintptr_t>(p) == handle) return true;
  }
  char buf[160];
  snprintf(buf, sizeof buf, "%s: group handle 0x%llx is not a live asap_comm group", fn,
           static_cast<unsigned long long>(handle));
  PyErr_SetString(PyExc_ValueError, buf);
  return false;
}

Group::Group(int rank, int world_size)
    : rank_(rank),
      world_(world_size),
      remote_(world_size, 0),
      rstate_(new std::atomic<uint32_t>[world_size]),
      rdone_(new std::atomic<uint64_t>[world_size]),
      ctrl_(world_size, nullptr),
      pid_(world_size, 0),
      pidfd_(world_size, -1) {
  for (int i = 0; i < world_size; ++i) {
    rstate_[i].store(kStateAlive, std::memory_order_relaxed);
    rdone_[i].store(0, std::memory_order_relaxed);
  }
  std::lock_guard<std::mutex> g(g_groups_mu);
  g_groups.push_back(this);
}

void Group::set_remote(int pe) { remote_[pe] = 1; }

void Group::set_remote_state(int pe, uint32_t state) {
  uint32_t cur = kStateAlive;
  // The first verdict stands: a PE that said goodbye and then dropped its
  // connection stays "closed".
  rstate_[pe].compare_exchange_strong(cur, state, std::memory_order_seq_cst);
  Ctrl* own = ctrl_[rank_];
  if (own != nullptr) {  // wake this PE's sleepers: they re-check liveness
    A(own->futex_seq).fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(&own->futex_seq);
  }
}

bool Group::closed_state(int pe) const {
  if (remote_[pe]) return rstate_[pe].load(std::memory_order_acquire) == kStateClosed;
  return A(ctrl_[pe]->state).load(std::memory_order_acquire) == kStateClosed;
}

Group::~Group() {
  {
    std::lock_guard<std::mutex> g(g_groups_mu);
    g_groups.erase(std::remove(g_groups.begin(), g_groups.end(), this), g_groups.end());
  }
  for (int fd : pidfd_)
    if (fd >= 0) close(fd);
}

void Group::set_peer(int pe, uintptr_t ctrl_addr, int pid) {
  ctrl_[pe] = reinterpret_cast<Ctrl*>(ctrl_addr);
  pid_[pe] = pid;
  if (pe != rank_ && pid > 0) {
    if (pidfd_[pe] >= 0) close(pidfd_[pe]);
    pidfd_[pe] = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
    // pidfd_open may be unavailable (old kernel, seccomp): fall back to procfs.
  }
}

bool Group::is_dead(int pe) const {
  if (pe == rank_) return false;
  if (remote_[pe]) return rstate_[pe].load(std::memory_order_acquire) == kStateDead;
  if (pidfd_[pe] >= 0) {
    struct pollfd p = {pidfd_[pe], POLLIN, 0};
    int r = poll(&p, 1, 0);
    return r > 0;  // readable once the process has terminated (zombie included)
  }
  return pid_[pe] > 0 && !pid_alive_procfs(pid_[pe]);
}

bool Group::gone(int pe) const {
  if (pe == rank_) return false;
  return closed_state(pe) || is_dead(pe);
}

bool Group::completed_round(int pe, uint64_t round) const {
  if (remote_[pe]) return rdone_[pe].load(std::memory_order_acquire) >= round;  // only a goodbye tells
  return ctrl_[pe] != nullptr && A(ctrl_[pe]->barrier_done).load(std::memory_order_acquire) >= round;
}

int Group::check(int dep, const char** why, const uint8_t* mask, uint64_t round) const {
  auto closed = [&](int pe) { return closed_state(pe); };
  if (dep >= 0) {
    if (dep == rank_) return -1;
    if (closed(dep)) { *why = "closed"; return dep; }
    if (is_dead(dep)) { *why = "died"; return dep; }
    return -1;
  }
  if (dep == kDepSet || dep == kDepOthers) {
    // Hopeless only when every PE that may satisfy the wait is gone.
    int last = -1;
    bool last_closed = false;
    for (int pe = 0; pe < world_; ++pe) {
      if (dep == kDepSet && (mask == nullptr || mask[pe] == 0)) continue;
      if (pe == rank_) {
        if (dep == kDepOthers) continue;
        return -1;  // this PE named itself: it may still satisfy the wait (another thread)
      }
      if (closed(pe)) { last = pe; last_closed = true; continue; }
      if (is_dead(pe)) { last = pe; last_closed = false; continue; }
      return -1;  // a live peer may still act
    }
    if (last < 0) return -1;
    if (dep == kDepSet)
      *why = last_closed ? "closed (every PE in peers has died or closed)" : "died (every PE in peers has died or closed)";
    else
      *why = last_closed ? "closed (no live producer remains: every other PE has died or closed)"
                         : "died (no live producer remains: every other PE has died or closed)";
    return last;
  }
  int gone = 0, first_closed = -1;
  for (int pe = 0; pe < world_; ++pe) {
    if (pe == rank_) continue;
    if (closed(pe)) {
      ++gone;
      if (first_closed < 0) first_closed = pe;
      if (dep == kDepBarrier && completed_round(pe, round)) continue;  // it left after this round
      if (dep == kDepAll || dep == kDepBarrier) { *why = "closed"; return pe; }
      continue;
    }
    if (is_dead(pe)) {
      if (dep == kDepBarrier && !remote_[pe] && completed_round(pe, round)) continue;
      *why = "died";
      return pe;
    }
  }
  if (dep == kDepAny && world_ > 1 && gone == world_ - 1) {
    *why = "closed (every other PE has closed)";
    return first_closed;
  }
  return -1;
}

void wake_if_sleeping(Ctrl* owner) {
  if (A(owner->sleepers).load(std::memory_order_seq_cst) != 0) {
    A(owner->futex_seq).fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(&owner->futex_seq);
  }
}

uint64_t signal_update(uint64_t* addr, uint64_t value, int op, Ctrl* owner) {
  uint64_t old;
  if (op == 0) {
    old = A(*addr).exchange(value, std::memory_order_seq_cst);
  } else {
    old = A(*addr).fetch_add(value, std::memory_order_seq_cst);
  }
  wake_if_sleeping(owner);
  return old;
}

void copy_bytes(void* dst, const void* src, size_t n) {
  if (n >= (size_t{1} << 16)) {
    Py_BEGIN_ALLOW_THREADS std::memcpy(dst, src, n);
    Py_END_ALLOW_THREADS
  } else {
    std::memcpy(dst, src, n);
  }
}

WaitResult wait_until(const uint64_t* addr, int cmp, uint64_t value, Ctrl* owner, double timeout_s,
                      const Group* group, int dep, const uint8_t* mask, const WaitHook* hook) {
  uint64_t* w = const_cast<uint64_t*>(addr);
  uint64_t v = A(*w).load(std::memory_order_acquire);
  if (cmp_ok(v, cmp, value)) return {kWaitOk, v, -1, nullptr};

  const auto start = Clock::now();
  const int64_t timeout_ns = timeout_s <= 0 ? 0
                             : timeout_s > 1e9 ? INT64_MAX / 4
                                               : static_cast<int64_t>(timeout_s * 1e9);
  auto elapsed_ns = [&] {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
  };

  // Phase 1: spin (GIL held: the caller asked to wait, nobody else in this
  // process can do its work for it in a few microseconds).
  // After a short pure spin, yield the CPU every few dozen polls: if the PE
  // we wait for shares this CPU (oversubscribed hosts), it runs at once
  // instead of after the whole spin budget.
  const int64_t spin_ns = std::min(spin_budget_ns(), timeout_ns);
  NetIface* net = group != nullptr ? group->net() : nullptr;
  if (net != nullptr) net->poll_begin();
  for (uint32_t i = 1;; ++i) {
    ASAP_CPU_RELAX();
    if (net != nullptr && (i & 7) == 0) net->poll();  // a remote update may be waiting in the engine
    v = A(*w).load(std::memory_order_acquire);
    if (cmp_ok(v, cmp, value)) {
      if (net != nullptr) net->poll_end(false);
      return {kWaitOk, v, -1, nullptr};
    }
    if ((i & 63) == 0) {
      const int64_t e = elapsed_ns();
      if (e >= spin_ns) break;
      if (e >= kPureSpinNs) sched_yield();
    }
  }
  if (net != nullptr) net->poll_end(true);

  // Phase 2: sleep on the owner's futex in slices.
  WaitResult res{kWaitTimeout, v, -1, nullptr};
  for (;;) {
    int64_t left = timeout_ns - elapsed_ns();
    const char* why = nullptr;
    int bad = group != nullptr ? group->check(dep, &why, mask, value) : -1;
    v = A(*w).load(std::memory_order_acquire);
    if (cmp_ok(v, cmp, value)) return {kWaitOk, v, -1, nullptr};
    if (hook != nullptr) {
      const char* hwhy = nullptr;
      const int hp = hook->check(v, &hwhy);
      if (hp >= 0) return {kWaitAbandoned, v, hp, hwhy};
    }
    if (bad >= 0) return {kWaitPeer, v, bad, why};
    if (left <= 0) return {kWaitTimeout, v, -1, nullptr};
    if (PyErr_CheckSignals() != 0) return {kWaitInterrupted, v, -1, nullptr};

    int64_t slice = std::min(left, kSliceNs);
    bool done = false;
    Py_BEGIN_ALLOW_THREADS
    A(owner->sleepers).fetch_add(1, std::memory_order_seq_cst);
    uint32_t seq = A(owner->futex_seq).load(std::memory_order_seq_cst);
    v = A(*w).load(std::memory_order_seq_cst);
    if (cmp_ok(v, cmp, value)) {
      done = true;
    } else {
      futex_wait(&owner->futex_seq, seq, slice);
    }
    A(owner->sleepers).fetch_sub(1, std::memory_order_seq_cst);
    Py_END_ALLOW_THREADS
    if (done) {
      std::atomic_thread_fence(std::memory_order_acquire);
      return {kWaitOk, v, -1, nullptr};
    }
  }
  return res;
}

}  // namespace asap
