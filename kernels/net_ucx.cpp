// UCX, loaded at run time (kernels/net_ucx.hpp).
#ifdef ASAP_HAVE_UCX
#include "net_ucx.hpp"

#include <dlfcn.h>

#include <mutex>
#include <stdexcept>

namespace asap::net {

Ucx ucx;
namespace {
std::mutex g_load_mu;
}  // namespace


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

}  // namespace asap::net
#endif  // ASAP_HAVE_UCX
