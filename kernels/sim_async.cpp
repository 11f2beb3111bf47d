// The simulator's ASAP mode as a native event loop (asap_comm.sim.core.native; docs/simulator.md, "Speed").
//
// A port, decision for decision, of asap_comm/sim/core/async_mode.py's _AsyncSim on engine.py's Engine/Rank, with
// the policies it calls (serving/policies.py: Placer, MicroBatcher, ExpertBatcher) and the long-prompt lane's
// runtime admission (sim/core/lane.py: the "pipe" design, admission "runtime"), for the configurations the Python
// glue lets through: dedicated devices (no shared CPU host), no lock-step ablation, no failures. Same
// events in the same order (the heap is ordered by (time, sequence) and every schedule takes the next sequence
// number, as Engine.at/after do), the same float operations in the same order, so the same answers.
//
// The cost model stays in Python: its operations are called back through `costs` (a Python object) once per
// distinct argument and memoised here (attention once per distinct micro-batch: its (tokens, cached) list).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <tuple>
#include <cmath>
#include <cstdint>
#include <deque>
#include <limits>
#include <map>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace asap {
namespace {

// cost operations of one integer argument (the order of native.py's _Costs.OPS)
enum Op { EMBED = 0, DENSE_MLP, ROUTER, SHARED, HEAD, MESSAGE, DISPATCH, COMBINE, NUM_OPS };

// events (the Python callback each stands for)
enum Ev : int32_t {
  EV_DELIVER = 1,   // _Common._deliver(rank, chunks of request a)
  EV_FILL_PENDING,  // _AsyncSim._fill_pending(rank)
  EV_RANK_DONE,     // Rank._done of attention rank a
  EV_EXPERT_ARRIVE, // _expert_arrive(mb a, rows b)
  EV_EX_END,        // _ex_end
  EV_WAKE,          // _wake
  EV_COMBINE_BACK,  // _combine_back(mb a)
  EV_RESULT,        // _Common._result(request a)
  EV_LANE_RESULT,   // Lane._result(request a)
  EV_GIVE_UP,       // Lane._give_up(request a)
  EV_DELIVER_FIFO,  // Lane._deliver_fifo(lane request a)
  EV_KV_ARRIVED,    // Lane._kv_arrived(lane request a, chunk b, layer c)
};

struct Event {
  double t;
  uint64_t seq;
  int32_t kind, a, b, c;
};
struct Later {  // a min-heap on (t, seq)
  bool operator()(const Event& x, const Event& y) const { return x.t > y.t || (x.t == y.t && x.seq > y.seq); }
};

// rank jobs (the callback each stands for)
enum JobKind : int32_t { JOB_DISPATCH = 1, JOB_TAIL, JOB_PART_BACK, JOB_LANE_HEAD, JOB_LANE_LAYER };
struct Job {
  double work;
  int32_t kind, mb, rows, k;
  bool moe;
  double put;
};

struct Span {  // (rank: -1 the expert rank, label kind: 0 an expert batch or the JobKind, label numbers, start, dur)
  int32_t rank, kind, a, b;
  double start, dur;
};

struct Chunk {
  int32_t req, index, start, length, num;
  bool solo;  // a lane chunk: alone in its micro-batch (MicroBatcher's _stride)
  bool queued;
  bool last() const { return index == num - 1; }
};

struct MB {
  int32_t rank, tokens, seg, waiting;
  double attn;
  std::vector<int32_t> chunks;
  int32_t lreq;  // -1: not a lane micro-batch
  int32_t j, sub, sub_seg;
};

struct AttRank {
  std::deque<Job> queue;
  bool busy = false;
  double started = 0.0, busy_s = 0.0;
  int64_t jobs = 0;
  Job current{};
};

struct Batcher {  // MicroBatcher's queue: chunk ids in arrival order; taken ones are skipped, compacted now and then
  std::vector<int32_t> q;
  size_t head = 0, dead = 0;
};

struct Pending {  // ExpertBatcher's _Pending
  int32_t layer;
  int64_t rows;
  double since;
  std::vector<std::pair<int32_t, int32_t>> items;  // (mb, rows)
};

struct LaneReq {
  int32_t q, n, g;
  std::vector<int32_t> ranks;
  std::vector<uint8_t> ready;  // [k * n + j]
  std::vector<std::vector<int32_t>> waiters;  // per layer k: mbs waiting for layer k's KV
  std::vector<double> fanout;  // per chunk: one layer's put (< 0: not computed yet)
  bool ready_at(int k, int j) const { return ready[(size_t)k * n + j] != 0; }
  bool all_ready(int k, int j) const {
    const uint8_t* p = &ready[(size_t)k * n];
    for (int i = 0; i < j; ++i)
      if (!p[i]) return false;
    return true;
  }
};

// a memo of one non-negative integer argument: a table below 2**20, a hash map above
struct Memo1 {
  std::vector<double> tab;  // NaN: not asked yet
  std::unordered_map<int64_t, double> big;
  const double* find(int64_t n) const {
    if (n >= 0 && n < (int64_t)tab.size()) return std::isnan(tab[n]) ? nullptr : &tab[n];
    if (n >= 0 && n < kDense) return nullptr;
    auto it = big.find(n);
    return it == big.end() ? nullptr : &it->second;
  }
  void put(int64_t n, double v) {
    if (n >= 0 && n < kDense) {
      if (n >= (int64_t)tab.size()) tab.resize(std::max<size_t>(n + 1, tab.size() * 2), std::nan(""));
      tab[n] = v;
    } else {
      big.emplace(n, v);
    }
  }
  static constexpr int64_t kDense = 1 << 20;
};

// (latency, fan-out, serial) of a transfer (_AsyncSim._link_times): memoised per (kind, rows, tokens, the
// MoE layer's weight), in a table per (kind, weight) indexed by tokens that remembers the rows it was asked with
struct LinkEntry {
  int64_t rows = -1;
  std::array<double, 3> v{};
};
class AsyncCore {
 public:
  AsyncCore(const py::dict& p, py::object costs) : costs_(std::move(costs)) {
    A = p["A"].cast<int>();
    E = p["E"].cast<int>();
    tp = p["tp"].cast<int>();
    max_running = p["max_running"].cast<int>();
    token_balanced = p["token_balanced"].cast<bool>();
    token_budget = p["token_budget"].cast<int64_t>();
    chunk_len = p["chunk_len"].cast<int64_t>();
    max_prompt_len = p["max_prompt_len"].cast<int64_t>();
    load_aware = p["load_aware"].cast<bool>();
    linear_weight = p["linear_weight"].cast<double>();
    frac = p["frac"].cast<double>();
    k_att = p["k_att"].cast<double>();
    k_exp = p["k_exp"].cast<double>();
    layer_overhead = p["layer_overhead"].cast<double>();
    job_overhead = p["job_overhead"].cast<double>();
    ex_job_overhead = p["ex_job_overhead"].cast<double>();
    ex_skew = p["ex_skew"].cast<double>();
    serial_tx = p["serial_tx"].cast<bool>();
    msg_result = p["msg_result"].cast<double>();
    hdr = p["hdr"].cast<int64_t>();
    ex_enabled = p["expert_batching"].cast<bool>();
    ex_budget = p["expert_token_budget"].cast<int64_t>();
    ex_deadline = p["expert_deadline_s"].cast<double>();
    for (auto s : p["segs"].cast<py::list>()) {
      auto t = s.cast<py::tuple>();
      seg_dense.push_back(t[0].cast<double>());
      seg_moe.push_back(t[1].cast<double>());
    }
    std::vector<double> weights;
    for (double w : seg_moe) {
      auto it = std::find(weights.begin(), weights.end(), w);
      seg_wclass.push_back((int)(it - weights.begin()));
      if (it == weights.end()) weights.push_back(w);
    }
    link_tab.resize(weights.size() * 2);
    spans_on = p["spans"].cast<bool>();
    lane_on = p["lane"].cast<bool>();
    if (lane_on) {
      lane_groups = p["lane_groups"].cast<int>();
      pool_rows = p["pool_rows"].cast<int64_t>();
      lane_wait_s = p["lane_wait_s"].cast<double>();  // < 0: None
      lane_threshold = p["lane_threshold"].cast<int64_t>();  // < 0: None
      lane_slo = p["lane_slo"].cast<bool>();
      lane_cost = p["lane_cost"].cast<bool>();
      pool_free = p["pool_slots"].cast<int64_t>();
      int k = 0;
      for (auto s : p["seg_layers"].cast<py::list>()) {
        std::vector<std::pair<double, bool>> layers;
        for (auto l : s.cast<py::list>()) {
          auto t = l.cast<py::tuple>();
          layers.emplace_back(t[0].cast<double>(), t[1].cast<bool>());
        }
        offset.push_back(k);
        k += (int)layers.size();
        seg_layers.push_back(std::move(layers));
      }
      steps = k;
    }
    att.resize(A);
    batchers.resize(A);
    running.assign(A, 0);
    fill_pending.assign(A, 0);
    work.assign(A, 0.0);
    for (int i = 0; i < NUM_OPS; ++i) op_fn[i] = costs_.attr("op")(i);
    attn_fn = costs_.attr("attn");
  }

  py::dict run(const std::vector<double>& arrival, const std::vector<int64_t>& plen) {
    N = (int32_t)arrival.size();
    arrival_ = arrival;
    plen_ = plen;
    start_s.assign(N, std::numeric_limits<double>::quiet_NaN());
    done_s.assign(N, std::numeric_limits<double>::quiet_NaN());
    error.assign(N, 0);
    first_chunk.assign(N, -1);
    busy_off.assign(N, -1);
    held_rank.assign(N, -1);
    held_work.assign(N, 0.0);
    lane_of.assign(N, -1);
    live.assign(N, 0);
    in_waiting.assign(N, 0);
    stamp.assign(N, 0);
    seq = (uint64_t)N;  // the arrivals took sequence numbers 0 .. N-1 (_Common._arrivals)
    size_t next_arrival = 0;
    for (;;) {
      bool have_ev = !heap.empty();
      bool have_arr = next_arrival < (size_t)N;
      if (!have_ev && !have_arr) break;
      // an arrival goes first at equal times: its sequence number is below every other event's
      if (have_arr && (!have_ev || arrival[next_arrival] <= heap.front().t)) {
        now = arrival[next_arrival];
        ++events;
        arrive((int32_t)next_arrival++);
        continue;
      }
      std::pop_heap(heap.begin(), heap.end(), Later());
      Event e = heap.back();
      heap.pop_back();
      if (e.kind == EV_WAKE && !(wake_active && wake_seq == e.seq)) continue;  // cancelled (Engine.cancel)
      now = e.t;
      ++events;
      dispatch(e);
      if ((events & ((1 << 22) - 1)) == 0 && PyErr_CheckSignals() != 0) throw py::error_already_set();  // Ctrl-C
    }
    py::dict out;
    out["end"] = now;
    out["events"] = events;
    out["start_s"] = start_s;
    out["done_s"] = done_s;
    out["error"] = error;
    std::vector<double> busy;
    std::vector<int64_t> jobs;
    for (auto& r : att) {
      busy.push_back(r.busy_s);
      jobs.push_back(r.jobs);
    }
    out["att_busy_s"] = busy;
    out["att_jobs"] = jobs;
    out["ex_busy_s"] = ex_busy_s;
    out["ex_jobs"] = ex_jobs;
    out["lane_waits"] = lane_waits;
    out["lane_waited"] = lane_waited;
    out["lane_gave_up"] = lane_gave_up;
    out["cost_calls"] = cost_calls;
    py::list sp;
    for (const Span& x : spans) sp.append(py::make_tuple(x.rank, x.kind, x.a, x.b, x.start, x.dur));
    out["spans"] = sp;
    return out;
  }

 private:
  // ------------------------------------------------------------------ parameters
  int A, E, tp, max_running;
  bool token_balanced, load_aware, serial_tx, ex_enabled, lane_on = false;
  int64_t token_budget, chunk_len, max_prompt_len, hdr, ex_budget;
  double linear_weight, frac, k_att, k_exp, layer_overhead, job_overhead, ex_job_overhead, ex_skew, msg_result,
      ex_deadline;
  std::vector<double> seg_dense, seg_moe;
  int lane_groups = 0, steps = 0;
  int64_t pool_rows = 0;
  double lane_wait_s = -1.0;
  int64_t lane_threshold = -1;
  bool lane_slo = false;
  bool lane_cost = false;  // RuntimeConfig.lane_chunks == "cost"
  std::vector<std::vector<std::pair<double, bool>>> seg_layers;
  std::vector<int> offset;

  py::object costs_;
  py::object op_fn[NUM_OPS];
  Memo1 op_memo[NUM_OPS];
  Memo1 ex_memo;
  std::vector<int> seg_wclass;  // segment -> its MoE weight's class (segments of one weight share link costs)
  std::vector<std::vector<LinkEntry>> link_tab;
  std::unordered_map<std::string, double> attn_memo;
  py::object attn_fn;
  std::unordered_map<int64_t, std::array<double, 3>> link_memo;
  std::unordered_map<int64_t, double> kv_memo;
  std::unordered_map<int64_t, bool> wants_memo;
  int64_t cost_calls = 0;
  bool spans_on = false;
  std::vector<Span> spans;

  // ------------------------------------------------------------------ state
  int32_t N = 0;
  std::vector<double> arrival_;
  std::vector<int64_t> plen_;
  std::vector<double> start_s, done_s;
  std::vector<int32_t> error;  // 0, 1: empty prompt, 2: longer than max_prompt_len
  double now = 0.0;
  double send_free = 0.0;  // when the front end's sender is free again (delivery_s)
  uint64_t seq = 0;
  int64_t events = 0;
  std::vector<Event> heap;

  std::vector<Chunk> chunks;
  std::vector<int32_t> first_chunk;  // request -> its first chunk (-1: not split yet)
  std::vector<uint8_t> busy_flags;   // MicroBatcher._busy: per request, one flag per rank it runs on
  std::vector<int32_t> busy_off;     // request -> its flags in busy_flags
  std::vector<MB> mbs;
  std::vector<int32_t> free_mbs;
  std::vector<AttRank> att;
  std::vector<Batcher> batchers;
  std::vector<int> running;
  std::vector<uint8_t> fill_pending;
  std::vector<int32_t> stamp;  // per request: the scan that took or passed it (next_batch's taken_requests)
  int32_t cur_stamp = 0;

  // Placer
  std::vector<double> work;
  int next_rr = 0;
  std::vector<int32_t> held_rank;  // the usual placement's rank (-1: a lane's, see LaneReq)
  std::vector<double> held_work;
  std::vector<std::vector<double>> lane_works;  // per lane request: work on each of its ranks

  // expert rank (direct)
  std::vector<Pending> layers_;  // ExpertBatcher._layers in insertion order
  std::deque<std::tuple<int32_t, int64_t, std::pair<int32_t, int32_t>>> ex_fifo;  // enabled=False
  double ex_free = 0.0, ex_in_free = 0.0, ex_out_free = 0.0, ex_busy_s = 0.0;
  int64_t ex_jobs = 0;
  bool ex_end_pending = false, wake_active = false;
  double wake_t = 0.0;
  uint64_t wake_seq = 0;

  // lane
  std::vector<LaneReq> lreqs;
  std::vector<int32_t> lane_of;  // request -> lane request (-1: none)
  std::vector<uint8_t> live, in_waiting;
  std::map<int64_t, int64_t> pool_spans;  // LanePool.spans: first row -> rows, of the lanes in flight
  std::unordered_map<int32_t, int64_t> pool_at;  // request -> its first row
  int64_t pool_free = 0;  // free slots
  std::deque<int32_t> waiting;  // Lane.waiting (first come first served; given-up ones are skipped)
  size_t waiting_n = 0;
  std::vector<double> lane_waits;
  int64_t lane_waited = 0, lane_gave_up = 0;

  // ------------------------------------------------------------------ engine
  uint64_t at(double t, int32_t kind, int32_t a = 0, int32_t b = 0, int32_t c = 0) {
    if (!(t >= now)) throw std::runtime_error("sim_async: an event scheduled before now");
    uint64_t s = seq++;
    heap.push_back(Event{t, s, kind, a, b, c});
    std::push_heap(heap.begin(), heap.end(), Later());
    return s;
  }
  uint64_t after(double delay, int32_t kind, int32_t a = 0, int32_t b = 0, int32_t c = 0) {
    if (!(delay >= 0) || delay == std::numeric_limits<double>::infinity())
      throw std::runtime_error("sim_async: a delay that is negative or not finite");
    uint64_t s = seq++;
    heap.push_back(Event{now + delay, s, kind, a, b, c});
    std::push_heap(heap.begin(), heap.end(), Later());
    return s;
  }

  void dispatch(const Event& e) {
    switch (e.kind) {
      case EV_DELIVER: deliver(e.a, e.b); break;
      case EV_FILL_PENDING:
        fill_pending[e.a] = 0;
        fill(e.a);
        break;
      case EV_RANK_DONE: rank_done(e.a); break;
      case EV_EXPERT_ARRIVE: expert_arrive(e.a, e.b); break;
      case EV_EX_END:
        ex_end_pending = false;
        poke();
        break;
      case EV_WAKE:
        wake_active = false;
        poke();
        break;
      case EV_COMBINE_BACK: part_back(e.a); break;
      case EV_RESULT: result(e.a); break;
      case EV_LANE_RESULT: lane_result(e.a); break;
      case EV_GIVE_UP: give_up(e.a); break;
      case EV_DELIVER_FIFO: deliver_fifo(e.a); break;
      case EV_KV_ARRIVED: kv_arrived(e.a, e.b, e.c); break;
      default: throw std::runtime_error("sim_async: unknown event");
    }
  }

  // ------------------------------------------------------------------ costs (Python, memoised)
  double op(int kind, int64_t n) {
    Memo1& m = op_memo[kind];
    if (const double* v = m.find(n)) return *v;
    ++cost_calls;
    double v = op_fn[kind](n).cast<double>();
    if (std::isnan(v)) throw std::runtime_error("sim_async: a cost that is not a number");
    m.put(n, v);
    return v;
  }
  // attention of a micro-batch: memoised on its (length, start) pairs in order
  double attention(const std::vector<int32_t>& ids) {
    std::string key;
    key.reserve(ids.size() * 8);
    for (int32_t c : ids) {
      int32_t v[2] = {chunks[c].length, chunks[c].start};
      key.append(reinterpret_cast<const char*>(v), sizeof v);
    }
    auto it = attn_memo.find(key);
    if (it != attn_memo.end()) return it->second;
    py::list lengths, starts;
    for (int32_t c : ids) {
      lengths.append(chunks[c].length);
      starts.append(chunks[c].start);
    }
    ++cost_calls;
    double v = attn_fn(lengths, starts).cast<double>();
    attn_memo.emplace(std::move(key), v);
    return v;
  }
  double experts(int64_t tokens) {
    if (const double* v = ex_memo.find(tokens)) return *v;
    ++cost_calls;
    double v = costs_.attr("experts")(tokens).cast<double>();
    if (std::isnan(v)) throw std::runtime_error("sim_async: a cost that is not a number");
    ex_memo.put(tokens, v);
    return v;
  }
  const std::array<double, 3>& link(int kind, int64_t rows, int64_t tokens, int seg) {
    int cls = seg_wclass[seg] * 2 + kind;
    auto& tab = link_tab[cls];
    if (tokens >= 0 && tokens < (int64_t)Memo1::kDense) {
      if (tokens >= (int64_t)tab.size()) tab.resize(std::max<size_t>(tokens + 1, tab.size() * 2));
      LinkEntry& e = tab[tokens];
      if (e.rows == rows) return e.v;
      if (e.rows < 0) {
        e.v = link_call(kind, rows, tokens, seg);
        e.rows = rows;
        return e.v;
      }
    }
    int64_t key = ((int64_t)cls << 52) ^ (tokens << 26) ^ rows;  // rows, tokens < 2**26
    auto it = link_memo.find(key);
    if (it != link_memo.end()) return it->second;
    return link_memo.emplace(key, link_call(kind, rows, tokens, seg)).first->second;
  }
  std::array<double, 3> link_call(int kind, int64_t rows, int64_t tokens, int seg) {
    ++cost_calls;
    auto t = costs_.attr("link")(kind, rows, tokens, seg).cast<py::tuple>();
    return {t[0].cast<double>(), t[1].cast<double>(), t[2].cast<double>()};
  }
  double kv_put(int64_t length, int64_t fan) {
    int64_t key = (length << 20) ^ fan;
    auto it = kv_memo.find(key);
    if (it != kv_memo.end()) return it->second;
    ++cost_calls;
    double v = costs_.attr("kv_put")(length, fan).cast<double>();
    kv_memo.emplace(key, v);
    return v;
  }

  // ------------------------------------------------------------------ front end
  int validate(int64_t P) const { return P < 1 ? 1 : (P > max_prompt_len ? 2 : 0); }

  int32_t num_chunks_of(int64_t P) const { return chunk_len == 0 ? 1 : (int32_t)((P + chunk_len - 1) / chunk_len); }

  // split_prompt (once per request: the usual and the lane's admission split alike)
  int32_t split(int32_t q) {
    if (first_chunk[q] >= 0) return first_chunk[q];
    int64_t P = plen_[q];
    int32_t n = num_chunks_of(P);
    int64_t base = P / n, extra = P % n, start = 0;
    first_chunk[q] = (int32_t)chunks.size();
    for (int32_t i = 0; i < n; ++i) {
      int64_t len = base + (i < extra ? 1 : 0);
      chunks.push_back(Chunk{q, i, (int32_t)start, (int32_t)len, n, false, false});
      start += len;
    }
    return first_chunk[q];
  }

  // serving.lane.lane_split with lane_chunks="cost": policies.split_equal_cost into max(split_prompt's count, two per
  // group) chunks (at most one a token) of near-equal attention cost, none longer than chunk_len, in its float
  // operations (Python's round: half to even, as nearbyint in the default rounding mode)
  int32_t split_cost(int32_t q, int g) {
    int64_t P = plen_[q];
    int64_t n = std::min<int64_t>(P, std::max<int64_t>(num_chunks_of(P), 2 * (int64_t)g));
    int64_t cap = chunk_len;
    double w = linear_weight;
    auto cost_to = [w](double e) { return w * e + e * e / 2.0; };
    std::vector<int64_t> bounds{0};
    for (int64_t i = 1; i < n; ++i) {
      int64_t s = bounds.back(), left = n - i + 1;
      double share = (cost_to((double)P) - cost_to((double)s)) / (double)left;
      double x = (double)s + w;
      int64_t e = (int64_t)std::nearbyint(-w + std::sqrt(x * x + 2.0 * share));
      e = std::max(std::max(e, s + 1), P - (left - 1) * cap);
      e = std::min(std::min(e, s + cap), P - (left - 1));
      bounds.push_back(e);
    }
    bounds.push_back(P);
    first_chunk[q] = (int32_t)chunks.size();
    for (int64_t i = 0; i < n; ++i)
      chunks.push_back(Chunk{q, (int32_t)i, (int32_t)bounds[i], (int32_t)(bounds[i + 1] - bounds[i]), (int32_t)n,
                             false, false});
    return first_chunk[q];
  }

  double attention_cost(const Chunk& c) const {  // policies.attention_cost, in its float operations
    double T = (double)c.length;
    double v = (double)((int64_t)c.length * c.start) + (double)((int64_t)c.length * (c.length + 1)) / 2.0;
    return v + linear_weight * T;
  }

  double delivery_s(int32_t q) {  // _Common._delivery_s: the front end sends chunk after chunk, in admission order
    int32_t f = first_chunk[q];
    double s = 0.0;
    for (int32_t i = 0; i < chunks[f].num; ++i) s += op(MESSAGE, 8 * (chunks[f + i].length + hdr));
    send_free = std::max(now, send_free) + s;
    return send_free - now;
  }

  void arrive(int32_t q) {
    if (lane_on && lane_arrive(q)) return;
    common_arrive(q);
  }

  void common_arrive(int32_t q) {  // _Common.arrive / _admit
    int err = validate(plen_[q]);
    if (err) {
      start_s[q] = done_s[q] = now;
      error[q] = err;
      return;
    }
    int32_t f = split(q);
    // Placer.place
    double w = 0.0;
    for (int32_t i = 0; i < chunks[f].num; ++i) w += attention_cost(chunks[f + i]);
    int rank;
    if (load_aware) {
      rank = 0;
      for (int r = 1; r < A; ++r)
        if (work[r] < work[rank]) rank = r;
    } else {
      rank = next_rr;
      next_rr = (next_rr + 1) % A;
    }
    work[rank] += w;
    held_rank[q] = rank;
    held_work[q] = w;
    busy_off[q] = (int32_t)busy_flags.size();
    busy_flags.push_back(0);
    start_s[q] = now;
    after(delivery_s(q), EV_DELIVER, rank, q);
  }

  void deliver(int rank, int32_t q) {
    int32_t f = first_chunk[q];
    for (int32_t i = 0; i < chunks[f].num; ++i) batcher_add(rank, f + i, false);
    queued(rank);
  }

  void result(int32_t q) {  // _Common._result: the record and Placer.complete
    done_s[q] = now;
    if (held_rank[q] >= 0) {
      int r = held_rank[q];
      work[r] = std::max(0.0, work[r] - held_work[q]);
      held_rank[q] = -1;
    } else if (lane_of[q] >= 0) {
      LaneReq& L = lreqs[lane_of[q]];
      auto& ws = lane_works[lane_of[q]];
      for (int i = 0; i < L.g; ++i) work[L.ranks[i]] = std::max(0.0, work[L.ranks[i]] - ws[i]);
    }
  }

  // ------------------------------------------------------------------ MicroBatcher
  void batcher_add(int rank, int32_t c, bool solo) {
    chunks[c].solo = solo;
    chunks[c].queued = true;
    batchers[rank].q.push_back(c);
  }

  bool busy_of(const Chunk& c) const {
    int32_t q = c.req;
    int pos = c.solo ? c.index % lreqs[lane_of[q]].g : 0;
    return busy_flags[busy_off[q] + pos] != 0;
  }
  void set_busy(const Chunk& c, bool v) {
    int32_t q = c.req;
    int pos = c.solo ? c.index % lreqs[lane_of[q]].g : 0;
    busy_flags[busy_off[q] + pos] = v;
  }

  void taken(int rank, int32_t c) {  // MicroBatcher._taken
    Batcher& b = batchers[rank];
    chunks[c].queued = false;
    ++b.dead;
    set_busy(chunks[c], true);
  }

  void compact(Batcher& b) {
    while (b.head < b.q.size() && !chunks[b.q[b.head]].queued) {
      ++b.head;
      --b.dead;
    }
    if (b.dead > 64 && b.dead * 2 > b.q.size() - b.head) {
      size_t w = 0;
      for (size_t i = b.head; i < b.q.size(); ++i)
        if (chunks[b.q[i]].queued) b.q[w++] = b.q[i];
      b.q.resize(w);
      b.head = 0;
      b.dead = 0;
    } else if (b.head > 4096 && b.head * 2 > b.q.size()) {
      b.q.erase(b.q.begin(), b.q.begin() + b.head);
      b.head = 0;
    }
  }

  // Lane.ready_fn: a live lane's chunk may start once every earlier chunk another rank computes has put layer 0
  bool ready(const Chunk& c, int rank) const {
    int32_t L = lane_of[c.req];
    if (L < 0 || !live[c.req]) return true;
    const LaneReq& R = lreqs[L];
    for (int k = c.index - 1; k >= 0; --k) {  // serving.lane.chunk_may_start
      if (R.ranks[k % R.g] == rank) return true;
      if (!R.ready_at(0, k)) return false;
    }
    return true;
  }

  std::vector<int32_t> next_batch(int rank) {
    Batcher& b = batchers[rank];
    std::vector<int32_t> batch;
    int64_t tokens = 0;
    int32_t st = ++cur_stamp;
    for (size_t i = b.head; i < b.q.size(); ++i) {
      const Chunk& c = chunks[b.q[i]];
      if (!c.queued) continue;
      if (busy_of(c) || stamp[c.req] == st) continue;
      if (!ready(c, rank)) {
        stamp[c.req] = st;
        continue;
      }
      bool solo = c.solo;
      if (!batch.empty() && (solo || tokens + c.length > token_budget)) {
        stamp[c.req] = st;
        continue;
      }
      batch.push_back(b.q[i]);
      stamp[c.req] = st;
      tokens += c.length;
      if (tokens >= token_budget || solo) break;
    }
    for (int32_t c : batch) taken(rank, c);
    compact(b);
    return batch;
  }

  std::vector<std::vector<int32_t>> next_batches(int rank, int count) {
    Batcher& b = batchers[rank];
    std::vector<int32_t> picked;
    int64_t total = 0, cap = (int64_t)count * token_budget;
    int32_t st = ++cur_stamp;
    for (size_t i = b.head; i < b.q.size(); ++i) {
      const Chunk& c = chunks[b.q[i]];
      if (!c.queued) continue;
      if (busy_of(c) || stamp[c.req] == st) continue;
      stamp[c.req] = st;
      if (!ready(c, rank)) continue;
      if (!picked.empty() && total + c.length > cap) continue;
      picked.push_back(b.q[i]);
      total += c.length;
      if (total >= cap) break;
    }
    std::vector<int32_t> order(picked.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = (int32_t)i;
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t x, int32_t y) { return chunks[picked[x]].length > chunks[picked[y]].length; });
    std::vector<std::vector<int32_t>> bins(count);  // positions in picked
    std::vector<int64_t> load(count, 0);
    std::vector<uint8_t> solo(count, 0);
    for (int32_t i : order) {
      const Chunk& c = chunks[picked[i]];
      bool alone = c.solo;
      int best = -1;
      for (int k = 0; k < count; ++k) {
        bool fits = !solo[k] && (bins[k].empty() || (!alone && load[k] + c.length <= token_budget));
        if (fits && (best < 0 || load[k] < load[best])) best = k;
      }
      if (best < 0) continue;
      bins[best].push_back(i);
      load[best] += c.length;
      solo[best] = alone;
    }
    std::vector<int> nonempty;
    for (int k = 0; k < count; ++k)
      if (!bins[k].empty()) nonempty.push_back(k);
    std::stable_sort(nonempty.begin(), nonempty.end(), [&](int x, int y) { return load[x] > load[y]; });
    std::vector<std::vector<int32_t>> out;
    for (int k : nonempty) {
      std::sort(bins[k].begin(), bins[k].end());  // FIFO inside a micro-batch
      std::vector<int32_t> batch;
      for (int32_t i : bins[k]) batch.push_back(picked[i]);
      for (int32_t c : batch) taken(rank, c);
      out.push_back(std::move(batch));
    }
    compact(b);
    return out;
  }

  void batcher_done(int32_t c) { set_busy(chunks[c], false); }

  // ------------------------------------------------------------------ attention ranks
  void submit(int rank, const Job& j, bool front = false) {
    AttRank& r = att[rank];
    if (front)
      r.queue.push_front(j);
    else
      r.queue.push_back(j);
    if (!r.busy) start_job(rank);
  }
  void start_job(int rank) {
    AttRank& r = att[rank];
    Job j = r.queue.front();
    r.queue.pop_front();
    r.busy = true;
    r.started = now;
    r.current = j;
    if (!(j.work >= 0)) throw std::runtime_error("sim_async: a job of negative work");
    after(j.work, EV_RANK_DONE, rank);
  }
  void rank_done(int rank) {
    AttRank& r = att[rank];
    Job j = r.current;
    r.busy_s += now - r.started;
    r.jobs += 1;
    if (spans_on) {  // Rank._done's span: the job's label is (kind, a, b); native.py writes it out
      int32_t a = 0, b = 0;
      if (j.kind == JOB_DISPATCH) a = mbs[j.mb].seg;
      if (j.kind == JOB_LANE_LAYER) a = j.k, b = mbs[j.mb].j;
      spans.push_back(Span{rank, j.kind, a, b, r.started, now - r.started});
    }
    r.busy = false;
    switch (j.kind) {
      case JOB_DISPATCH: dispatched(j.mb, j.rows); break;
      case JOB_TAIL: tail_done(j.mb); break;
      case JOB_PART_BACK: part_back(j.mb); break;
      case JOB_LANE_HEAD: lane_done(j.mb); break;
      case JOB_LANE_LAYER: lane_layer_done(j.mb, j.k, j.moe, j.rows, j.put); break;
    }
    AttRank& r2 = att[rank];
    if (!r2.busy && !r2.queue.empty()) start_job(rank);
  }

  // ------------------------------------------------------------------ _AsyncSim
  int64_t rows_of(int64_t tokens) const {
    if (!tokens) return 0;
    double v = std::nearbyint((double)tokens * frac);  // Python's round: half to even
    return std::max<int64_t>(1, (int64_t)v);
  }
  int64_t per_device(int64_t tokens) const { return (tokens + tp - 1) / tp; }

  void queued(int rank) {
    if (token_balanced && max_running - running[rank] >= 2) {
      if (!fill_pending[rank]) {
        fill_pending[rank] = 1;
        after(0.0, EV_FILL_PENDING, rank);
      }
      return;
    }
    fill(rank);
  }

  void fill(int rank) {
    int limit = max_running;  // the runtime admission's lane reserves no slot (Lane.reserved)
    if (token_balanced && limit - running[rank] >= 2) {
      auto bs = next_batches(rank, 2);
      for (auto& b : bs) start_batch(rank, b);
    }
    while (running[rank] < limit) {
      auto b = next_batch(rank);
      if (b.empty()) return;
      start_batch(rank, b);
    }
  }

  int32_t new_mb() {
    if (!free_mbs.empty()) {
      int32_t i = free_mbs.back();
      free_mbs.pop_back();
      return i;
    }
    mbs.emplace_back();
    return (int32_t)mbs.size() - 1;
  }

  void start_batch(int rank, std::vector<int32_t>& batch) {
    if (lane_on && batch.size() == 1 && lane_of[chunks[batch[0]].req] >= 0 && live[chunks[batch[0]].req]) {
      run_chunk(rank, batch[0]);
      return;
    }
    running[rank] += 1;
    double attn = attention(batch);
    int32_t i = new_mb();
    MB& m = mbs[i];
    m.rank = rank;
    m.chunks = std::move(batch);
    m.attn = attn;
    m.tokens = 0;
    for (int32_t c : m.chunks) m.tokens += chunks[c].length;
    m.seg = 0;
    m.waiting = 0;
    m.lreq = -1;
    segment(i, true);
  }

  void segment(int32_t i, bool first = false) {
    if (mbs[i].lreq >= 0) {
      lane_segment(i);
      return;
    }
    MB& m = mbs[i];
    int64_t T = m.tokens, Td = per_device(T);
    double dense = seg_dense[m.seg], moe = seg_moe[m.seg];
    double w = (first ? op(EMBED, T) : 0.0) + dense * (m.attn + op(DENSE_MLP, Td));
    if (moe != 0.0) {
      int64_t rows = rows_of(Td);
      w += moe * (m.attn + op(ROUTER, Td));
      submit(m.rank, Job{w * k_att + job_overhead, JOB_DISPATCH, i, (int32_t)rows, 0, false, 0.0});
    } else {
      int64_t last = 0;
      for (int32_t c : m.chunks) last += chunks[c].last() ? 1 : 0;
      w += last ? op(HEAD, last) : 0.0;
      submit(m.rank, Job{w * k_att + job_overhead, JOB_TAIL, i, 0, 0, false, 0.0});
    }
  }

  void dispatched(int32_t i, int64_t rows) {
    MB& m = mbs[i];
    m.waiting = 2;
    double w = seg_moe[m.seg];
    submit(m.rank, Job{w * op(SHARED, per_device(m.tokens)) * k_att, JOB_PART_BACK, i, 0, 0, false, 0.0}, true);
    double delay = serial_tx ? 0.0 : through_link(DISPATCH, i, rows, ex_in_free, now);
    after(delay, EV_EXPERT_ARRIVE, i, (int32_t)rows);
  }

  // _through_expert_link: the delay, and the expert rank's link free again (updates link_free)
  double through_link(int kind, int32_t i, int64_t rows, double& link_free, double t) {
    const MB& m = mbs[i];
    const auto& v = link(kind == DISPATCH ? 0 : 1, rows, m.tokens, m.seg);
    double lat = v[0], fan = v[1], serial = v[2];
    link_free = (t < link_free ? link_free : t) + serial;
    double x = link_free - t;
    return (fan < x ? x : fan) + lat;
  }

  void expert_arrive(int32_t i, int64_t rows) {
    const MB& m = mbs[i];
    int64_t r = tp == 1 ? rows : rows_of(m.tokens);
    std::pair<int32_t, int32_t> item{i, (int32_t)rows};
    if (!ex_enabled) {
      ex_fifo.emplace_back(m.seg, r, item);
    } else {
      bool found = false;
      for (auto& p : layers_)
        if (p.layer == m.seg) {
          p.rows += r;
          p.items.push_back(item);
          found = true;
          break;
        }
      if (!found) layers_.push_back(Pending{m.seg, r, now, {item}});
    }
    poke();
  }

  bool ex_held() const { return !layers_.empty() || !ex_fifo.empty(); }

  void poke() {
    if (now < ex_free) {
      if (!ex_end_pending) {
        ex_end_pending = true;
        at(ex_free, EV_EX_END);
      }
      return;
    }
    // ExpertBatcher.poll
    int layer = -1;
    bool has_wait = false;
    double wait = 0.0;
    size_t pick = 0;
    if (!ex_enabled) {
      if (!ex_fifo.empty()) layer = std::get<0>(ex_fifo.front());
    } else if (!layers_.empty()) {
      int64_t full_rows = -1;
      int full = -1;
      size_t full_at = 0, oldest_at = 0;
      double since = 0.0;
      for (size_t k = 0; k < layers_.size(); ++k) {
        const Pending& p = layers_[k];
        if (p.rows >= ex_budget && p.rows > full_rows) {
          full = p.layer;
          full_rows = p.rows;
          full_at = k;
        }
        if (k == 0 || p.since < since) {
          since = p.since;
          oldest_at = k;
        }
      }
      if (full >= 0) {
        layer = full;
        pick = full_at;
      } else if (now - since >= ex_deadline) {
        layer = layers_[oldest_at].layer;
        pick = oldest_at;
      } else {
        has_wait = true;
        double x = since + ex_deadline - now;
        wait = 0.0 < x ? x : 0.0;
      }
    }
    if (layer < 0) {
      if (has_wait) {
        double a = now + (wait < 1e-9 ? 1e-9 : wait);
        double b = std::nextafter(now, std::numeric_limits<double>::infinity());
        double t = a < b ? b : a;
        if (!wake_active || wake_t > t) {
          wake_active = true;  // replaces (cancels) a later wake-up
          wake_t = t;
          wake_seq = at(t, EV_WAKE);
        }
      }
      return;
    }
    std::vector<std::pair<int32_t, int32_t>> items;
    if (!ex_enabled) {
      items.push_back(std::get<2>(ex_fifo.front()));
      ex_fifo.pop_front();
    } else {
      items = std::move(layers_[pick].items);
      layers_.erase(layers_.begin() + pick);
    }
    int64_t tokens = 0;
    for (auto& it : items) tokens += mbs[it.first].tokens;
    double w = seg_moe[layer];
    double wk = w * experts(tokens);
    if (serial_tx) {
      int64_t r = 0;
      for (auto& it : items) r += tp == 1 ? it.second : rows_of(mbs[it.first].tokens);
      wk += w * (op(DISPATCH, r) + op(COMBINE, r)) / k_exp;
    }
    double skew = ex_skew == 1.0 ? 1.0 : batch_skew(items);
    wk = wk * k_exp * skew + ex_job_overhead;
    double end = now + wk;
    ex_busy_s += end - now;
    ex_jobs += 1;
    if (spans_on) spans.push_back(Span{-1, 0, layer, (int32_t)items.size(), now, end - now});
    ex_free = end;
    if (wake_active) wake_active = false;  // Engine.cancel of the pending wake-up
    if (ex_held()) {
      ex_end_pending = true;
      at(end, EV_EX_END);
    }
    for (auto& it : items) {
      double delay = (serial_tx ? 0.0 : through_link(COMBINE, it.first, it.second, ex_out_free, end)) + layer_overhead;
      at(end + delay, EV_COMBINE_BACK, it.first);
    }
  }

  double batch_skew(const std::vector<std::pair<int32_t, int32_t>>& items) const {  // common.batch_skew
    std::vector<std::pair<int32_t, int64_t>> per;
    for (auto& it : items)
      for (int32_t c : mbs[it.first].chunks) {
        const Chunk& ch = chunks[c];
        bool found = false;
        for (auto& p : per)
          if (p.first == ch.req) {
            p.second += ch.length;
            found = true;
            break;
          }
        if (!found) per.emplace_back(ch.req, (int64_t)ch.length);
      }
    int64_t total = 0, sq = 0;
    for (auto& p : per) {
      total += p.second;
      sq += p.second * p.second;
    }
    if (total <= 0) return ex_skew;
    return 1.0 + (ex_skew - 1.0) * std::sqrt((double)sq) / (double)total;
  }

  void part_back(int32_t i) {
    MB& m = mbs[i];
    m.waiting -= 1;
    if (m.waiting == 0) {
      m.seg += 1;
      segment(i);
    }
  }

  void tail_done(int32_t i) {
    MB& m = mbs[i];
    int rank = m.rank;
    for (int32_t c : m.chunks) {
      batcher_done(c);
      if (chunks[c].last()) after(msg_result, EV_RESULT, chunks[c].req);
    }
    m.chunks.clear();
    free_mbs.push_back(i);
    running[rank] -= 1;
    fill(rank);
  }

  // ------------------------------------------------------------------ the lane (runtime admission, "pipe")
  // serving.lane.lane_groups: of a prompt of n split_prompt chunks (twice n with lane chunks of equal cost)
  int groups_for(int n) const { return std::min(std::min(lane_groups ? lane_groups : A, A), lane_cost ? 2 * n : n); }

  bool lane_arrive(int32_t q) {
    int64_t P = plen_[q];
    if (validate(P) || chunk_len == 0) return false;
    int32_t n = num_chunks_of(P);
    if (n < 2) return false;
    // Lane.wants: two groups or more, then the threshold, else the predicted TTFT against the SLO (Python's)
    if (groups_for(n) < 2) return false;
    bool wants = true;
    if (lane_threshold >= 0) {
      wants = P > lane_threshold;
    } else if (lane_slo) {
      auto it = wants_memo.find(P);
      if (it != wants_memo.end()) {
        wants = it->second;
      } else {
        ++cost_calls;
        wants = costs_.attr("lane_wants")(P).cast<bool>();
        wants_memo.emplace(P, wants);
      }
    }
    if (!wants) return false;
    if (P > pool_rows) return false;
    if (lane_cost)
      split_cost(q, groups_for(n));
    else
      split(q);
    waiting.push_back(q);
    in_waiting[q] = 1;
    ++waiting_n;
    open_waiting();
    if (in_waiting[q]) {
      ++lane_waited;
      if (lane_wait_s >= 0) after(lane_wait_s, EV_GIVE_UP, q);
    }
    return true;
  }

  // LanePool._place without cancelled lanes: the first fit of n rows among the lanes' rows (-1: none)
  int64_t pool_place(int64_t n) const {
    int64_t at_row = 0;
    for (const auto& [b, m] : pool_spans) {
      if (b - at_row >= n) return at_row;
      at_row = std::max(at_row, b + m);
    }
    return pool_rows - at_row >= n ? at_row : -1;
  }

  void give_up(int32_t q) {
    if (!in_waiting[q]) return;
    in_waiting[q] = 0;
    --waiting_n;
    ++lane_gave_up;
    if (lane_cost) first_chunk[q] = -1;  // the usual way splits by split_prompt (the lane's chunks unused)
    common_arrive(q);
  }

  void open_waiting() {
    for (;;) {
      while (!waiting.empty() && !in_waiting[waiting.front()]) waiting.pop_front();  // gave up
      if (waiting.empty()) return;
      int32_t q = waiting.front();
      int64_t at_row = pool_place(plen_[q]);
      if (pool_free == 0 || at_row < 0) return;  // LanePool.fits
      waiting.pop_front();
      in_waiting[q] = 0;
      --waiting_n;
      --pool_free;  // LanePool.open: a slot and the rows
      pool_spans.emplace(at_row, plen_[q]);
      pool_at[q] = at_row;
      int32_t f = first_chunk[q];
      int32_t n = chunks[f].num;
      int g = groups_for(num_chunks_of(plen_[q]));  // Lane.arrive's, of the split_prompt count
      // Placer.place_lane: the g least loaded ranks (ties to the lowest), chunk j's cost on ranks[j % g]
      std::vector<int32_t> order(A);
      for (int r = 0; r < A; ++r) order[r] = r;
      std::stable_sort(order.begin(), order.end(), [&](int32_t x, int32_t y) { return work[x] < work[y]; });
      LaneReq L;
      L.q = q;
      L.n = n;
      L.g = g;
      L.ranks.assign(order.begin(), order.begin() + g);
      std::vector<double> ws(g, 0.0);
      for (int32_t j = 0; j < n; ++j) ws[j % g] += attention_cost(chunks[f + j]);
      for (int k = 0; k < g; ++k) work[L.ranks[k]] += ws[k];
      L.ready.assign((size_t)steps * n, 0);
      L.waiters.assign(steps, {});
      L.fanout.assign(n, -1.0);
      start_s[q] = now;
      lane_of[q] = (int32_t)lreqs.size();
      lreqs.push_back(std::move(L));
      lane_works.push_back(std::move(ws));
      live[q] = 1;
      busy_off[q] = (int32_t)busy_flags.size();
      busy_flags.resize(busy_flags.size() + g, 0);
      double wt = now - arrival_[q];
      lane_waits.push_back(0.0 < wt ? wt : 0.0);  // LaneCounts.open
      after(delivery_s(q), EV_DELIVER_FIFO, lane_of[q]);
    }
  }

  std::vector<int32_t> sorted_ranks(const LaneReq& L, int except) const {
    std::vector<int32_t> rs;
    for (int32_t r : L.ranks)
      if (r != except && std::find(rs.begin(), rs.end(), r) == rs.end()) rs.push_back(r);
    std::sort(rs.begin(), rs.end());
    return rs;
  }

  void deliver_fifo(int32_t li) {
    const LaneReq& L = lreqs[li];
    int32_t f = first_chunk[L.q];
    for (int32_t j = 0; j < L.n; ++j) batcher_add(L.ranks[j % L.g], f + j, true);
    for (int32_t r : sorted_ranks(lreqs[li], -1)) queued(r);
  }

  void run_chunk(int rank, int32_t c) {
    const Chunk& ch = chunks[c];
    int32_t li = lane_of[ch.req];
    std::vector<int32_t> one{c};
    double attn = attention(one);
    int32_t i = new_mb();
    MB& m = mbs[i];
    m.rank = rank;
    m.chunks = std::move(one);
    m.tokens = ch.length;
    m.attn = attn;
    m.seg = m.waiting = m.sub = m.sub_seg = 0;
    m.lreq = li;
    m.j = ch.index;
    running[rank] += 1;
    lane_segment(i);
  }

  void lane_segment(int32_t i) {
    MB& m = mbs[i];
    if (m.seg != m.sub_seg) {
      m.sub_seg = m.seg;
      m.sub = 0;
    }
    lane_step(i);
  }

  void lane_step(int32_t i) {
    MB& m = mbs[i];
    const auto& layers = seg_layers[m.seg];
    LaneReq& L = lreqs[m.lreq];
    if (m.sub == (int)layers.size()) {
      if (m.j == L.n - 1)
        submit(m.rank, Job{op(HEAD, 1) * k_att, JOB_LANE_HEAD, i, 0, 0, false, 0.0});
      else
        lane_done(i);
      return;
    }
    int k = offset[m.seg] + m.sub;
    if (L.all_ready(k, m.j))
      lane_layer(i, k);
    else
      L.waiters[k].push_back(i);
  }

  void lane_layer(int32_t i, int k) {
    MB& m = mbs[i];
    LaneReq& L = lreqs[m.lreq];
    auto [w, moe] = seg_layers[m.seg][m.sub];
    int64_t T = m.tokens, Td = per_device(T);
    double wk = (k == 0 ? op(EMBED, T) : 0.0) + w * m.attn;
    int64_t rows = 0;
    if (moe) {
      rows = rows_of(Td);
      wk += w * op(ROUTER, Td);
    } else {
      wk += w * op(DENSE_MLP, Td);
    }
    double one = L.fanout[m.j];
    if (one < 0) {
      std::vector<int32_t> later;
      for (int32_t x = m.j + 1; x < L.n; ++x) {
        int32_t r = L.ranks[x % L.g];
        if (r != m.rank && std::find(later.begin(), later.end(), r) == later.end()) later.push_back(r);
      }
      one = L.fanout[m.j] = kv_put(chunks[first_chunk[L.q] + m.j].length, (int64_t)later.size());
    }
    double put = w * one;
    submit(m.rank, Job{wk * k_att + (moe ? job_overhead : 0.0), JOB_LANE_LAYER, i, (int32_t)rows, k, moe, put});
  }

  void lane_layer_done(int32_t i, int k, bool moe, int64_t rows, double put) {
    MB& m = mbs[i];
    after(put, EV_KV_ARRIVED, m.lreq, m.j, k);
    if (moe) {
      dispatched(i, rows);
    } else {
      m.sub += 1;
      lane_step(i);
    }
  }

  void kv_arrived(int32_t li, int32_t j, int32_t k) {
    lreqs[li].ready[(size_t)k * lreqs[li].n + j] = 1;
    if (k == 0)
      for (int32_t r : sorted_ranks(lreqs[li], lreqs[li].ranks[j % lreqs[li].g])) fill(r);
    LaneReq& L = lreqs[li];
    if (!L.waiters[k].empty()) {
      std::vector<int32_t> go, stay;
      for (int32_t m : L.waiters[k]) (L.all_ready(k, mbs[m].j) ? go : stay).push_back(m);
      L.waiters[k] = std::move(stay);
      for (int32_t m : go) lane_layer(m, k);
    }
  }

  void lane_done(int32_t i) {
    MB& m = mbs[i];
    int rank = m.rank;
    LaneReq& L = lreqs[m.lreq];
    running[rank] -= 1;
    batcher_done(m.chunks[0]);
    if (m.j == L.n - 1) after(msg_result, EV_LANE_RESULT, L.q);
    m.chunks.clear();
    free_mbs.push_back(i);
    fill(rank);
  }

  void lane_result(int32_t q) {
    result(q);
    if (live[q]) {
      live[q] = 0;
      ++pool_free;  // LanePool.close
      pool_spans.erase(pool_at[q]);
      open_waiting();
    }
  }
};

}  // namespace

void bind_sim_async(py::module& m) {
  m.def(
      "sim_async_run",
      [](const py::dict& params, py::object costs, const std::vector<double>& arrival,
         const std::vector<int64_t>& prompt_len) {
        if (arrival.size() != prompt_len.size())
          throw py::value_error("sim_async_run: arrival and prompt_len differ in length");
        AsyncCore core(params, std::move(costs));
        return core.run(arrival, prompt_len);
      },
      py::arg("params"), py::arg("costs"), py::arg("arrival"), py::arg("prompt_len"),
      "Run the simulator's ASAP mode natively (asap_comm.sim.core.native builds the arguments).");
}

}  // namespace asap
