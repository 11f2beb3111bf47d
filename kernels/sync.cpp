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
constexpr int64_t kMinSpinNs = 2000;             // the adaptive spin budget's floor
constexpr uint64_t kRecentUs = 1000;             // a run_stamp this fresh counts (shares_cpu)

// run_stamp of the calling thread at time `now`: (steady-clock us << 16) |
// (CPU + 1); 0 if the CPU is unknown.
uint64_t make_stamp(Clock::time_point now = Clock::now()) {
  const int cpu = sched_getcpu();  // glibc reads it from rseq: a load, no syscall
  if (cpu < 0 || cpu >= 0xffff) return 0;
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(now.time_since_epoch()).count();
  return (static_cast<uint64_t>(us) << 16) | static_cast<uint64_t>(cpu + 1);
}

// Publishes `stamp` in `me` unless it says what is there already (same CPU,
// under 64 us newer), so that peers reading it rarely pull the line away.
void publish_stamp(Ctrl* me, uint64_t stamp) {
  const uint64_t old = A(me->run_stamp).load(std::memory_order_relaxed);
  if (((old ^ stamp) & 0xffff) != 0 || (stamp >> 16) >= (old >> 16) + 64)
    A(me->run_stamp).store(stamp, std::memory_order_relaxed);
}

// The spin budget of one thread's waits, adapted to how they end:
// a wait that slept and was woken sooner than the configured budget (`cap`)
// would have been caught by a longer spin, so the budget grows at once (to
// 1.5x that wait, at most `cap`); waits that sleep far longer than `cap`
// (an idle waiter) halve it, from the second such wait in a row, down to
// kMinSpinNs, so that an idle waiter goes to sleep after a few
// microseconds instead of spinning the whole budget each time. Waits that
// end while spinning leave it as it is.
struct SpinBudget {
  int64_t ns = -1;  // the current budget; -1: not yet set (starts at cap)
  int longs = 0;    // waits in a row that slept longer than 2 * cap
  int shared = 0;   // waits in a row that found a PE of the group on this CPU
  uint64_t moved_us = 0;  // when this thread last moved itself (move_off)

  int64_t get(int64_t cap) {
    if (ns < 0 || ns > cap) ns = cap;
    return ns;
  }
  void slept(int64_t waited_ns, int64_t cap) {
    if (waited_ns < cap) {
      longs = 0;
      ns = std::min(cap, std::max(2 * ns, waited_ns + waited_ns / 2));
    } else if (waited_ns > 2 * cap) {
      if (++longs >= 2) ns = std::max(std::min(cap, kMinSpinNs), ns / 2);
    } else {
      longs = 0;
    }
  }
};
thread_local SpinBudget t_spin;

constexpr int kSharedBeforeMove = 3;   // co-located waits in a row before move_off acts
constexpr uint64_t kMoveEveryUs = 20000;  // and at most this often

// This thread shares its CPU with another PE of `g` (stamp: its own run_stamp):
// moves itself to an allowed CPU on which no PE of the group ran lately, then
// lets itself run anywhere allowed again (the scheduler does the same to
// tasks of a busy CPU eventually, but hesitates for milliseconds, or for
// good while other processes keep the other CPUs busy, and two PEs taking
// turns on one CPU cost a context switch per message). Does nothing unless
// the last kSharedBeforeMove waits found a co-located PE and no move happened
// within kMoveEveryUs. Returns true if it moved.
bool move_off(const Group* g, Ctrl* me, uint64_t stamp) {
  SpinBudget& t = t_spin;
  const uint64_t now_us = stamp >> 16;
  if (t.shared < kSharedBeforeMove || now_us < t.moved_us + kMoveEveryUs) return false;
  t.moved_us = now_us;
  cpu_set_t allowed, used;
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) return false;
  CPU_ZERO(&used);
  CPU_SET((stamp & 0xffff) - 1, &used);
  for (int pe = 0; pe < g->world_size(); ++pe) {
    Ctrl* c = g->ctrl(pe);
    if (pe == g->rank() || g->is_remote(pe) || c == nullptr) continue;
    const uint64_t s = A(c->run_stamp).load(std::memory_order_relaxed);
    if ((s & 0xffff) != 0 && (s >> 16) + kRecentUs >= now_us && (s & 0xffff) - 1 < CPU_SETSIZE)
      CPU_SET((s & 0xffff) - 1, &used);
  }
  // The first free allowed CPU after this one, offset by rank so that PEs
  // leaving one CPU together spread out.
  const int here = static_cast<int>((stamp & 0xffff) - 1);
  int target = -1;
  for (int k = 1; k < CPU_SETSIZE && target < 0; ++k) {
    const int c = (here + k + g->rank()) % CPU_SETSIZE;
    if (CPU_ISSET(c, &allowed) && !CPU_ISSET(c, &used)) target = c;
  }
  if (target < 0) return false;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(target, &one);
  if (sched_setaffinity(0, sizeof one, &one) != 0) return false;  // migrates this thread now
  if (sched_setaffinity(0, sizeof allowed, &allowed) != 0) {       // free to move again
    cpu_set_t all;  // the allowed set changed meanwhile (cpuset): never stay pinned to one CPU
    CPU_ZERO(&all);
    for (int c = 0; c < CPU_SETSIZE; ++c) CPU_SET(c, &all);
    sched_setaffinity(0, sizeof all, &all);
  }
  t.shared = 0;
  publish_stamp(me, make_stamp());
  return true;
}

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

bool Group::shares_cpu(uint64_t stamp, uint64_t window_us) const {
  const uint64_t cpu = stamp & 0xffff, now_us = stamp >> 16;
  if (cpu == 0) return false;
  for (int pe = 0; pe < world_; ++pe) {
    if (pe == rank_ || remote_[pe] || ctrl_[pe] == nullptr) continue;
    const uint64_t s = A(ctrl_[pe]->run_stamp).load(std::memory_order_relaxed);
    if ((s & 0xffff) == cpu && (s >> 16) + window_us >= now_us) return true;
  }
  return false;
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
  // process can do its work for it in a few microseconds), for this thread's
  // adaptive budget (SpinBudget, at most ASAP_SPIN_NS). A waiter that finds
  // another PE of its group running lately on its own CPU (two PEs on one
  // CPU, as an unpinned pair often ends up) cannot be helped by spinning:
  // that PE runs only when this one stops. It moves to a free CPU
  // (move_off) if the sharing persists, and meanwhile yields every 64
  // polls. Otherwise it never yields: on a busy host sched_yield queues the
  // waiter behind other processes while its peer, on another CPU, answers.
  const int64_t cap = spin_budget_ns();
  int64_t spin_ns = -1;  // this thread's budget, looked up at the first check
  Ctrl* me = group != nullptr ? group->ctrl(group->rank()) : nullptr;
  bool shared = false;  // known only after the first 64 polls: a wait that ends sooner pays nothing for it
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
      const auto now = Clock::now();
      if (spin_ns < 0) spin_ns = std::min(t_spin.get(cap), timeout_ns);
      if (std::chrono::duration_cast<std::chrono::nanoseconds>(now - start).count() >= spin_ns) break;
      if (me != nullptr) {
        const uint64_t stamp = make_stamp(now);
        publish_stamp(me, stamp);
        shared = group->shares_cpu(stamp, kRecentUs);
        if (i == 64) {  // once per wait: count the waits in a row that share, maybe move
          t_spin.shared = shared ? t_spin.shared + 1 : 0;
          if (shared && move_off(group, me, stamp)) shared = false;
        }
        // Hand the CPU over. Only every 64 polls: each sched_yield pushes
        // this thread's deadline back by a time slice (EEVDF), so a yield on
        // every poll would queue it behind every other process on the CPU.
        if (shared) sched_yield();
      }
    }
  }
  if (net != nullptr) net->poll_end(true);

  // Phase 2: sleep on the owner's futex in slices.
  for (;;) {
    int64_t left = timeout_ns - elapsed_ns();
    const char* why = nullptr;
    int bad = group != nullptr ? group->check(dep, &why, mask, value) : -1;
    v = A(*w).load(std::memory_order_acquire);
    if (cmp_ok(v, cmp, value)) break;
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
      if (me != nullptr) A(me->run_stamp).store(0, std::memory_order_relaxed);  // asleep: not on any CPU
      futex_wait(&owner->futex_seq, seq, slice);
      if (me != nullptr) publish_stamp(me, make_stamp());
    }
    A(owner->sleepers).fetch_sub(1, std::memory_order_seq_cst);
    Py_END_ALLOW_THREADS
    if (done) {
      std::atomic_thread_fence(std::memory_order_acquire);
      break;
    }
  }
  t_spin.slept(elapsed_ns(), cap);
  return {kWaitOk, v, -1, nullptr};
}

}  // namespace asap
