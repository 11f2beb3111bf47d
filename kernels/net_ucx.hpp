// UCX, loaded at run time (dlopen of the libraries the libucx wheel ships): the
// module builds against UCX's headers but imports and runs without UCX when
// every PE is on one host. `ucx` holds the functions the engine calls.
#pragma once
#ifdef ASAP_HAVE_UCX
#include <ucp/api/ucp.h>

#include <string>

namespace asap::net {

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
extern Ucx ucx;

// Loads libucs and libucp (their paths) once per process; std::runtime_error if either lacks a symbol.
void load_ucx(const std::string& ucp_path, const std::string& ucs_path);

// "net: <what> failed: <UCX's status text>"
std::string ucs_err(const char* what, ucs_status_t st);

}  // namespace asap::net
#endif  // ASAP_HAVE_UCX
