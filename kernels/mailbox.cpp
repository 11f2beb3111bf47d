// The mailbox ring: bounded MPSC queue with per-slot sequence numbers
// (D. Vyukov's bounded queue), living in the consumer's shared memory.
#include <chrono>
#include <cstdio>
#include <cstring>

#include "asap_shm.hpp"

namespace asap {

namespace {
template <typename T>
inline std::atomic_ref<T> A(T& x) {
  return std::atomic_ref<T>(x);
}
inline SlotHeader* slot_at(uintptr_t base, size_t stride, uint64_t i) {
  return reinterpret_cast<SlotHeader*>(base + kMailboxHeaderBytes + i * stride);
}
}  // namespace

namespace {
// may_wait: false for the network engine's delivery thread (no GIL, no wait).
WaitResult ring_send_impl(uintptr_t base, size_t nslots, size_t slot_bytes, Ctrl* owner, uint32_t src_pe, int64_t tag,
                          uint32_t dtype, int ndim, const int64_t* dims, const void* payload, size_t nbytes,
                          double timeout_s, const Group* group, int dst_pe, bool may_wait) {
  auto* hdr = reinterpret_cast<MailboxHeader*>(base);
  const size_t stride = slot_stride(slot_bytes);
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    uint64_t pos = A(hdr->tail).load(std::memory_order_acquire);
    SlotHeader* s = slot_at(base, stride, pos % nslots);
    uint64_t seq = A(s->seq).load(std::memory_order_acquire);
    if (seq == slot_free(pos)) {
      // Claim the slot itself: the claim names this PE, so a consumer can
      // tell who left a slot half-written.
      if (!A(s->seq).compare_exchange_strong(seq, slot_claimed(pos, src_pe), std::memory_order_acq_rel)) continue;
      uint64_t expect = pos;
      A(hdr->tail).compare_exchange_strong(expect, pos + 1, std::memory_order_acq_rel);  // others may have helped
      s->magic = kSlotMagic;
      s->src = src_pe;
      s->tag = tag;
      s->nbytes = nbytes;
      s->dtype = dtype;
      s->ndim = static_cast<uint32_t>(ndim);
      for (int i = 0; i < ndim; ++i) s->shape[i] = dims[i];
      if (nbytes) {
        if (may_wait) copy_bytes(reinterpret_cast<char*>(s) + kSlotHeaderBytes, payload, nbytes);
        else std::memcpy(reinterpret_cast<char*>(s) + kSlotHeaderBytes, payload, nbytes);
      }
      A(s->seq).store(slot_full(pos), std::memory_order_seq_cst);  // publish (release)
      wake_if_sleeping(owner);
      return {kWaitOk, pos, -1, nullptr};
    }
    if (seq < slot_free(pos)) {
      // Full: slot pos % n still holds message pos - n (claimed, published
      // or not yet released). Wait until the consumer frees it for position
      // pos, with one deadline for the whole send however often the race is
      // lost.
      if (!may_wait) return {kWaitTimeout, seq, -1, nullptr};
      const double spent = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      WaitResult r = wait_until(&s->seq, kGe, slot_free(pos), owner, timeout_s > spent ? timeout_s - spent : 0.0,
                                group, dst_pe);
      if (r.status != kWaitOk) return r;
      continue;
    }
    // seq > free(pos): position pos is taken (claimed or later); help move the
    // tail past it, in case its producer stopped before doing so.
    if (seq_pos(seq) == pos) {
      uint64_t expect = pos;
      A(hdr->tail).compare_exchange_strong(expect, pos + 1, std::memory_order_acq_rel);
    }
  }
}
}  // namespace

WaitResult ring_send(uintptr_t base, size_t nslots, size_t slot_bytes, Ctrl* owner, uint32_t src_pe, int64_t tag,
                     uint32_t dtype, int ndim, const int64_t* dims, const void* payload, size_t nbytes,
                     double timeout_s, const Group* group, int dst_pe) {
  return ring_send_impl(base, nslots, slot_bytes, owner, src_pe, tag, dtype, ndim, dims, payload, nbytes, timeout_s,
                        group, dst_pe, true);
}

WaitResult ring_try_send(uintptr_t base, size_t nslots, size_t slot_bytes, Ctrl* owner, uint32_t src_pe, int64_t tag,
                         uint32_t dtype, int ndim, const int64_t* dims, const void* payload, size_t nbytes) {
  return ring_send_impl(base, nslots, slot_bytes, owner, src_pe, tag, dtype, ndim, dims, payload, nbytes, 0.0,
                        nullptr, -1, false);
}

namespace {
// During a recv: the slot at the head is claimed by a producer that is gone.
struct AbandonedSlot final : WaitHook {
  const Group* group;
  uint64_t pos;
  int check(uint64_t seen, const char** why) const override {
    if (group == nullptr || seq_pos(seen) != pos) return -1;
    const uint64_t code = seq_code(seen);
    if (code == 0 || code == kSeqFull) return -1;
    const int pe = static_cast<int>(code - 1);
    if (pe >= group->world_size() || !group->gone(pe)) return -1;
    *why = "died while writing a message";
    return pe;
  }
};
}  // namespace

RecvResult ring_recv(uintptr_t base, size_t nslots, size_t slot_bytes, uint32_t world, Ctrl* owner, double timeout_s,
                     const Group* group, const uint64_t* itemsizes, uint32_t num_dtypes) {
  RecvResult out{};
  auto* hdr = reinterpret_cast<MailboxHeader*>(base);
  const uint64_t pos = hdr->head;  // consumer-private
  out.pos = pos;
  SlotHeader* s = slot_at(base, slot_stride(slot_bytes), pos % nslots);
  uint64_t seq = A(s->seq).load(std::memory_order_acquire);
  AbandonedSlot hook;
  hook.group = group;
  hook.pos = pos;
  if (seq != slot_full(pos)) {
    if (timeout_s < 0) {
      const char* why = nullptr;
      const int pe = hook.check(seq, &why);
      if (pe < 0) {
        out.wait = {kWaitOk, 0, -1, nullptr};
        out.empty = true;
        return out;
      }
      out.wait = {kWaitAbandoned, seq, pe, why};
    } else {
      out.wait = wait_until(&s->seq, kGe, slot_full(pos), owner, timeout_s, group, kDepOthers, nullptr, &hook);
    }
    if (out.wait.status == kWaitAbandoned) {
      // Drop the half-written message: free the slot and move on, so the
      // messages of live producers behind it keep flowing.
      hdr->head = pos + 1;
      ring_release(base, nslots, slot_bytes, pos, owner);
      return out;
    }
    if (out.wait.status != kWaitOk) return out;
    seq = out.wait.value;
  }
  out.wait = {kWaitOk, seq, -1, nullptr};
  hdr->head = pos + 1;  // consumed, even if corrupt: a bad header is never re-read
  // Copy the header once, then validate the copy (a buggy producer cannot
  // change it between check and use).
  const uint32_t magic = s->magic, src = s->src, dtype = s->dtype, ndim = s->ndim;
  const uint64_t nbytes = s->nbytes;
  out.src = src;
  out.tag = s->tag;
  out.dtype = dtype;
  out.ndim = ndim;
  out.nbytes = nbytes;
  out.payload = reinterpret_cast<uintptr_t>(s) + kSlotHeaderBytes;
  char* err = out.error;
  if (seq != slot_full(pos)) snprintf(err, sizeof out.error, "slot sequence %llu inconsistent", (unsigned long long)seq);
  else if (magic != kSlotMagic) snprintf(err, sizeof out.error, "bad magic 0x%x", magic);
  else if (src >= world) snprintf(err, sizeof out.error, "source PE %u out of range [0, %u)", src, world);
  else if (nbytes > slot_bytes)
    snprintf(err, sizeof out.error, "nbytes %llu > slot_bytes %llu", (unsigned long long)nbytes,
             (unsigned long long)slot_bytes);
  else if (dtype >= num_dtypes) snprintf(err, sizeof out.error, "dtype code %u unknown", dtype);
  else if (ndim > static_cast<uint32_t>(kMaxDims)) snprintf(err, sizeof out.error, "ndim %u > %d", ndim, kMaxDims);
  if (!err[0]) {
    unsigned __int128 numel = 1;
    for (uint32_t i = 0; i < ndim; ++i) {
      out.dims[i] = s->shape[i];
      if (out.dims[i] < 0) {
        snprintf(err, sizeof out.error, "negative dim %lld", (long long)out.dims[i]);
        break;
      }
      numel *= static_cast<uint64_t>(out.dims[i]);
      if (numel > slot_bytes) numel = static_cast<unsigned __int128>(slot_bytes) + 1;  // clamp: stays too big
    }
    if (!err[0] && numel * itemsizes[dtype] != nbytes)
      snprintf(err, sizeof out.error, "shape does not match nbytes %llu", (unsigned long long)nbytes);
  }
  if (err[0]) ring_release(base, nslots, slot_bytes, pos, owner);  // do not block producers behind it
  return out;
}

void ring_release(uintptr_t base, size_t nslots, size_t slot_bytes, uint64_t pos, Ctrl* owner) {
  SlotHeader* s = slot_at(base, slot_stride(slot_bytes), pos % nslots);
  A(s->seq).store(slot_free(pos + nslots), std::memory_order_seq_cst);
  wake_if_sleeping(owner);
}

void mailbox_init(uintptr_t base, size_t slot_bytes, size_t num_slots) {
  auto* h = reinterpret_cast<MailboxHeader*>(base);
  std::memset(h, 0, sizeof *h);
  const size_t stride = slot_stride(slot_bytes);
  for (size_t i = 0; i < num_slots; ++i) {
    auto* s = reinterpret_cast<SlotHeader*>(base + kMailboxHeaderBytes + i * stride);
    std::memset(s, 0, sizeof *s);
    A(s->seq).store(slot_free(i), std::memory_order_relaxed);
  }
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

}  // namespace asap
