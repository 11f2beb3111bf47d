// Shared-memory segments: create (0600, O_EXCL), map, unlink; the registry of mapped ranges.
#include <Python.h>

#include <algorithm>
#include <cerrno>
#include <mutex>
#include <vector>
#include <cstring>
#include <fcntl.h>
#include <stdexcept>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "asap_shm.hpp"

namespace asap {

namespace {
std::string errno_text(const char* what, const std::string& name) {
  return std::string(what) + "(" + name + "): " + std::strerror(errno);
}

struct Range {
  uintptr_t lo, hi;  // [lo, hi)
};
std::mutex g_ranges_mu;
std::vector<Range> g_ranges;  // sorted by lo; mappings never overlap

void register_range(void* p, size_t n) {
  const auto lo = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> g(g_ranges_mu);
  auto it = std::lower_bound(g_ranges.begin(), g_ranges.end(), lo, [](const Range& r, uintptr_t v) { return r.lo < v; });
  g_ranges.insert(it, Range{lo, lo + n});
}

void unregister_range(void* p) {
  const auto lo = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> g(g_ranges_mu);
  auto it = std::lower_bound(g_ranges.begin(), g_ranges.end(), lo, [](const Range& r, uintptr_t v) { return r.lo < v; });
  if (it != g_ranges.end() && it->lo == lo) g_ranges.erase(it);
}

}  // namespace

bool mapped_range(uintptr_t addr, size_t n) {
  std::lock_guard<std::mutex> g(g_ranges_mu);
  auto it = std::upper_bound(g_ranges.begin(), g_ranges.end(), addr, [](uintptr_t v, const Range& r) { return v < r.lo; });
  if (it == g_ranges.begin()) return false;
  --it;  // the last range starting at or below addr
  return addr >= it->lo && addr <= it->hi && n <= it->hi - addr;
}

bool check_mapped(const char* fn, const char* what, uintptr_t addr, size_t n) {
  if (mapped_range(addr, n)) return true;
  char buf[256];
  snprintf(buf, sizeof buf, "%s: %s [0x%llx, 0x%llx) is not inside a mapped asap_comm segment", fn, what,
           static_cast<unsigned long long>(addr), static_cast<unsigned long long>(addr + n));
  PyErr_SetString(PyExc_ValueError, buf);
  return false;
}

Mapping::~Mapping() {
  if (addr_ != nullptr) {
    unregister_range(addr_);
    munmap(addr_, size_);
  }
  if (fd_ >= 0) close(fd_);
}

int Mapping::reserve(size_t offset, size_t n) const {
  if (fd_ < 0) return EBADF;
  if (offset > size_ || n > size_ - offset) return EINVAL;
  if (n == 0) return 0;
  // posix_fallocate returns the error number (it does not set errno); tmpfs implements it natively.
  int r;
  do {
    r = posix_fallocate(fd_, static_cast<off_t>(offset), static_cast<off_t>(n));
  } while (r == EINTR);
  return r;
}

Mapping* create_segment(const std::string& name, size_t size) {
  if (size == 0) throw std::invalid_argument("create_segment: size must be > 0");
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw std::runtime_error(errno_text("shm_open", name));
  // fchmod in case the umask widened or narrowed the mode.
  if (fchmod(fd, 0600) != 0 || ftruncate(fd, static_cast<off_t>(size)) != 0) {
    std::string msg = errno_text("ftruncate", name);
    close(fd);
    shm_unlink(name.c_str());
    throw std::runtime_error(msg);
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int saved = errno;
  if (p == MAP_FAILED) {
    close(fd);
    errno = saved;
    std::string msg = errno_text("mmap", name);
    shm_unlink(name.c_str());
    throw std::runtime_error(msg);
  }
  register_range(p, size);
  return new Mapping(p, size, fd);  // keeps fd: the owner allocates ranges for real (reserve)
}

Mapping* map_segment(const std::string& name, size_t size) {
  int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) throw std::runtime_error(errno_text("shm_open", name));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    std::string msg = errno_text("fstat", name);
    close(fd);
    throw std::runtime_error(msg);
  }
  if (static_cast<size_t>(st.st_size) != size) {
    close(fd);
    throw std::runtime_error("map_segment(" + name + "): size " + std::to_string(st.st_size) +
                             " != expected " + std::to_string(size));
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int saved = errno;
  close(fd);
  if (p == MAP_FAILED) {
    errno = saved;
    throw std::runtime_error(errno_text("mmap", name));
  }
  register_range(p, size);
  return new Mapping(p, size);
}

bool unlink_segment(const std::string& name) { return shm_unlink(name.c_str()) == 0; }

}  // namespace asap
