// Shared-memory segments: create (0600, O_EXCL), map, unlink.
#include <cerrno>
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
}  // namespace

Mapping::~Mapping() {
  if (addr_ != nullptr) munmap(addr_, size_);
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
  close(fd);
  if (p == MAP_FAILED) {
    errno = saved;
    std::string msg = errno_text("mmap", name);
    shm_unlink(name.c_str());
    throw std::runtime_error(msg);
  }
  return new Mapping(p, size);
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
  return new Mapping(p, size);
}

bool unlink_segment(const std::string& name) { return shm_unlink(name.c_str()) == 0; }

}  // namespace asap
