// The network engine: receiving (applying messages, replies, rendezvous data) (kernels/net_engine.hpp).
#ifdef ASAP_HAVE_UCX
#include "net_engine.hpp"

#include <cstring>
#include "handles.hpp"

namespace asap::net {

// ---------------------------------------------------------------- receiving (mu_ held)
ucs_status_t NetEngine::on_am(void* arg, const void* header, size_t header_length, void* data, size_t length,
                          const ucp_am_recv_param_t* param) {
  auto* self = static_cast<NetEngine*>(arg);
  if (header_length != sizeof(Hdr)) {
    ++self->bad_;
    return UCS_OK;
  }
  Hdr h;
  std::memcpy(&h, header, sizeof h);
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  const ucp_ep_h via = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 ? param->reply_ep : nullptr;
  return self->handle(h, data, length, rndv, via);
}

void NetEngine::on_ep_error(void* arg, ucp_ep_h ep, ucs_status_t) {
  auto* self = static_cast<NetEngine*>(arg);
  for (int pe = 0; pe < self->world_; ++pe)
    if (self->eps_[pe] == ep) self->mark(pe, kStateDead);
}

void NetEngine::mark(int pe, uint32_t state) {
  if (debug_)
    fprintf(stderr, "[asap net] PE %d: PE %d -> %s (was %u)\n", rank_, pe, state == kStateClosed ? "closed" : "dead",
            group_->remote_state(pe));
  group_->set_remote_state(pe, state);
  std::lock_guard<std::mutex> lk(cv_mu_);
  cv_.notify_all();
}

void NetEngine::reply(int pe, const Hdr& req, int32_t status, uint64_t value, const char* data, size_t n) {
  Deferred d;
  d.pe = pe;
  d.h = Hdr{};
  d.h.kind = kReply;
  d.h.src = static_cast<uint32_t>(rank_);
  d.h.token = req.token;
  d.h.status = status;
  d.h.value = value;
  d.data = data;
  d.n = n;
  deferred_.push_back(d);
}

ucs_status_t NetEngine::handle(Hdr& h, void* data, size_t length, bool rndv, ucp_ep_h via) {
  ++received_;
  const int src = static_cast<int>(h.src);
  // The endpoint must be the one opened to the PE the header names: a message from any other endpoint
  // (a process outside the group, or a member claiming another's rank) is dropped unread.
  if (src < 0 || src >= world_ || eps_[src] == nullptr || via != eps_[src]) {
    ++unauth_;
    last_error_ = "dropped a message from an endpoint that is not the named sender's";
    return UCS_OK;
  }
  if (h.seq != rx_seq_[src]) ++disorder_;  // the named sender's own endpoint: its sequence counts
  rx_seq_[src] = h.seq + 1;
  if (h.kind == kHello || h.kind == kHelloAck) {
    if (rndv || length != kHandshakeBytes) {
      ++unauth_;
      return UCS_OK;
    }
    std::lock_guard<std::mutex> g(hs_mu_);
    if (handshakes_.size() < 4 * static_cast<size_t>(world_))
      handshakes_.push_back({src, h.kind, std::string(static_cast<const char*>(data), length)});
    return UCS_OK;
  }
  if (!authed_[src]) {  // the peer has not answered this PE's challenge (yet): nothing of it is applied
    ++unauth_;
    last_error_ = "dropped a message from PE " + std::to_string(src) + " before it authenticated";
    return UCS_OK;
  }
  if (fenced(src, h)) return UCS_OK;  // dead to this PE: nothing of it is applied (a rendezvous's data is not read)
  switch (h.kind) {
    case kHeartbeat: return UCS_OK;
    case kClose:
      group_->set_remote_done(src, h.value);  // before the state: a waiter that sees "closed" sees this too
      mark(src, kStateClosed);
      reply(src, h, kReplyOk, 0, nullptr, 0);
      return UCS_OK;
    case kReply: return on_reply(h, data, length, rndv);
    case kQuiet: reply(src, h, kReplyOk, 0, nullptr, 0); return UCS_OK;
    case kSignal:
    case kSignalFetch: {
      char* s = resolve(h.sig_region, h.sig_off, 8);
      if (s == nullptr || (h.sig_off & 7) != 0 || h.op > 1) {
        ++bad_;
        if (h.kind == kSignalFetch) reply(src, h, kReplyBad, 0, nullptr, 0);
        return UCS_OK;
      }
      const uint64_t old = signal_update(reinterpret_cast<uint64_t*>(s), h.value, static_cast<int>(h.op), own_);
      if (h.kind == kSignalFetch) reply(src, h, kReplyOk, old, nullptr, 0);
      return UCS_OK;
    }
    case kGet: {
      char* p = resolve(h.region, h.off, h.nbytes);
      if (p == nullptr) {
        ++bad_;
        reply(src, h, kReplyBad, 0, nullptr, 0);
        return UCS_OK;
      }
      reply(src, h, kReplyOk, 0, p, h.nbytes);
      return UCS_OK;
    }
    case kPut:
    case kPutSignal: {
      char* dst = resolve(h.region, h.off, h.nbytes);
      char* sig = h.kind == kPutSignal ? resolve(h.sig_region, h.sig_off, 8) : nullptr;
      if (dst == nullptr || length != h.nbytes || (h.kind == kPutSignal && (sig == nullptr || (h.sig_off & 7)))) {
        ++bad_;
        last_error_ = std::string("dropped a ") + kind_name(h.kind) + " from PE " + std::to_string(src) +
                      ": range out of bounds";
        return UCS_OK;
      }
      if (!rndv) {
        if (length) std::memcpy(dst, data, length);
        finish_put(h);
        return UCS_OK;
      }
      return recv_rndv(h, data, nullptr, length);  // into a buffer: applied once complete, unless fenced
    }
    case kMbox: {
      char* base = resolve(h.region, h.off, 0);
      const bool fits = base != nullptr && h.nslots > 0 && h.slot_bytes >= h.nbytes && h.ndim <= kMaxDims &&
                        resolve(h.region, h.off, mailbox_bytes(h.slot_bytes, h.nslots)) != nullptr &&
                        length == h.nbytes && (h.off & 63) == 0;
      if (!fits) {
        ++bad_;
        reply(src, h, kReplyBad, 0, nullptr, 0);
        return UCS_OK;
      }
      if (!rndv) {
        deliver_mbox(h, data);
        return UCS_OK;
      }
      return recv_rndv(h, data, nullptr, length);
    }
    default: ++bad_; return UCS_OK;
  }
}

bool NetEngine::fenced(int src, const Hdr& h) {
  if (group_->remote_state(src) != kStateDead) return false;
  ++fenced_;
  last_error_ = std::string("dropped a ") + kind_name(h.kind) + " from PE " + std::to_string(src) + ": it is dead (fenced)";
  return true;
}

void NetEngine::finish_put(const Hdr& h) {
  if (h.kind == kPutSignal) {
    char* sig = resolve(h.sig_region, h.sig_off, 8);
    signal_update(reinterpret_cast<uint64_t*>(sig), h.value, static_cast<int>(h.op), own_);
  }
}

void NetEngine::deliver_mbox(const Hdr& h, const void* payload) {
  const uintptr_t base = reinterpret_cast<uintptr_t>(resolve(h.region, h.off, 0));
  WaitResult r = ring_try_send(base, h.nslots, h.slot_bytes, own_, h.src, h.tag, h.dtype, static_cast<int>(h.ndim),
                               h.dims, payload, h.nbytes);
  reply(static_cast<int>(h.src), h, r.status == kWaitOk ? kReplyOk : kReplyFull, r.value, nullptr, 0);
}

ucs_status_t NetEngine::recv_rndv(const Hdr& h, void* desc, char* dst, size_t length) {
  auto* c = new RndvCtx{this, h, {}};
  if (dst == nullptr) {
    c->tmp.resize(length);
    dst = c->tmp.data();
  }
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  rp.cb.recv_am = &NetEngine::on_rndv_done;
  rp.user_data = c;
  void* req = ucx.ucp_am_recv_data_nbx(worker_, desc, dst, length, &rp);
  if (req == nullptr) {
    rndv_finished(c, UCS_OK);
  } else if (UCS_PTR_IS_ERR(req)) {
    rndv_finished(c, UCS_PTR_STATUS(req));
  }
  return UCS_INPROGRESS;
}

void NetEngine::on_rndv_done(void* req, ucs_status_t st, size_t, void* user) {
  auto* c = static_cast<RndvCtx*>(user);
  c->eng->rndv_finished(c, st);
  ucx.ucp_request_free(req);
}

void NetEngine::rndv_finished(RndvCtx* c, ucs_status_t st) {
  const Hdr& h = c->h;
  if (st != UCS_OK) {
    last_error_ = ucs_err("receiving a rendezvous message", st);
    if (h.kind == kMbox) reply(static_cast<int>(h.src), h, kReplyFull, 0, nullptr, 0);
  } else if (h.kind != kReply && fenced(static_cast<int>(h.src), h)) {
    // its sender was declared dead while the data travelled: dropped
  } else if (h.kind == kMbox) {
    deliver_mbox(h, c->tmp.data());
  } else if (h.kind == kReply) {
    Pending* p = lookup(h.token);
    if (p != nullptr) complete(p);
  } else {
    if (h.nbytes) std::memcpy(resolve(h.region, h.off, h.nbytes), c->tmp.data(), h.nbytes);  // checked on arrival
    finish_put(h);
  }
  delete c;
}

ucs_status_t NetEngine::on_reply(const Hdr& h, void* data, size_t length, bool rndv) {
  Pending* p = lookup(h.token);
  if (p == nullptr) return UCS_OK;  // its requester gave up
  p->status = h.status;
  p->value = h.value;
  if (length > 0 && h.status == kReplyOk) {
    if (p->dst == nullptr || length > p->cap) {
      p->status = kReplyBad;
      snprintf(p->error, sizeof p->error, "reply of %zu bytes does not fit %zu", length, p->cap);
      if (rndv) return UCS_OK;  // drops the descriptor
    } else if (rndv) {
      return recv_rndv(h, data, static_cast<char*>(p->dst), length);
    } else {
      std::memcpy(p->dst, data, length);
    }
  }
  if (h.status == kReplyBad && p->error[0] == 0) snprintf(p->error, sizeof p->error, "%s", "out of bounds");
  complete(p);
  return UCS_OK;
}

// Sends the replies the handlers queued (mu_ held; not from a callback).
void NetEngine::run_deferred() {
  while (!deferred_.empty()) {
    Deferred d = deferred_.front();
    deferred_.pop_front();
    if (eps_[d.pe] == nullptr || group_->remote_state(d.pe) == kStateDead) continue;
    void* req = send_nb(d.pe, d.h, d.data, d.n);
    // Nobody waits for a reply's completion: UCX frees the request when it
    // ends. The data it reads (a get's range) lives in a registered region.
    if (req != nullptr && req != reinterpret_cast<void*>(-1)) ucx.ucp_request_free(req);
  }
}

}  // namespace asap::net
#endif  // ASAP_HAVE_UCX
