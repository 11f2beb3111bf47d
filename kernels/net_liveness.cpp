// The network engine: the liveness lines to the PEs on other hosts (kernels/net_engine.hpp).
#ifdef ASAP_HAVE_UCX
#include "net_engine.hpp"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <stdexcept>

namespace asap::net {

// The liveness line to PE `pe` (a connected TCP socket, already authenticated): the engine keeps a
// duplicate of `fd`, sets its keepalive so that a lost host or link fails it within the peer timeout,
// and watches it from then on (before start()).
void NetEngine::watch(int pe, int fd) {
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

// Reads PE `pe`'s liveness line (mu_ held; non-blocking): its goodbye marks the PE closed (with the
// barrier round it completed), an end without one or an error marks it dead. Then the line is closed.
void NetEngine::check_line(int pe) {
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

void NetEngine::drop_line(int pe) {
  if (lines_[pe] < 0) return;
  if (line_epoll_ >= 0) epoll_ctl(line_epoll_, EPOLL_CTL_DEL, lines_[pe], nullptr);
  ::close(lines_[pe]);
  lines_[pe] = -1;
}

// The lines, every 100 ms from whichever thread progresses (mu_ held): a backstop for the progress
// thread's epoll, which wakes on them at once.
void NetEngine::tick() {
  for (int pe = 0; pe < world_; ++pe) check_line(pe);
}

}  // namespace asap::net
#endif  // ASAP_HAVE_UCX
