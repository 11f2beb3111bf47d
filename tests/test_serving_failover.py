"""Expert failover (docs/failover.md): with a spare expert PE, an expert worker SIGKILLed under load costs no request
(every admitted one answered, equal to the reference forward) in run_async and in the HTTP service; /health shows
the replacement and /metrics counts it; once no spare is left, the next death fails the group as before (the
service answers 503 naming the PE and exits 3), and nothing is left behind. Attention failover
(--attention-failover): an attention PE SIGKILLed mid-run or under load costs no request either (its requests,
lane prompts through it among them, are re-admitted on the other attention rank) and is counted."""
import glob
import os
import re
import signal
import threading
import time
from collections import deque

import httpx
import pytest
import torch

from asap_comm.errors import PeerFailure
from asap_comm.serving.failover import READMIT_BASE
from asap_comm.serving.frontend import FrontEnd
from asap_comm.serving.protocol import CANCEL, decode_cancel, decode_chunk, encode_result
from asap_comm.serving.runtime import RuntimeConfig, run_async
from asap_comm.testing.service import Service, wait_dead
from serving_utils import CFG, INFO, TinyFactory, check_against_reference, make_trace

from models import random_init

pytestmark = pytest.mark.slow  # serving groups of A + E + S + 1 processes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOIN_S = 60  # the longest a load thread may take to end once told to
LAUNCH_SEGMENT = re.compile(r"/dev/shm/asap-[0-9a-f]{12}-")  # asap_comm.launch's segment names


class KillFirstHolder:
    """Builds the tiny model's halves; the expert PE that holds expert 0 *first* SIGKILLs itself after ``after``
    expert calls (a file created with O_EXCL marks it, so the spare that takes its experts over lives)."""

    def __init__(self, after: int, mark: str) -> None:
        self.after, self.mark, self.inner = after, mark, TinyFactory()

    def __call__(self, role: str, experts: list):
        model = self.inner(role, experts)
        if role != "expert" or not experts or experts[0] != 0:
            return model
        calls, inner, after, mark = [0], model.expert, self.after, self.mark

        def expert(layer, e, x, weights=None):
            calls[0] += 1
            if calls[0] > after:
                try:
                    os.close(os.open(mark, os.O_CREAT | os.O_EXCL))
                except FileExistsError:  # the spare serving the same experts: not killed
                    pass
                else:
                    os.kill(os.getpid(), signal.SIGKILL)
            return inner(layer, e, x, weights)

        model.expert = expert
        return model


def test_run_async_loses_nothing_when_an_expert_pe_dies_with_a_spare(tmp_path):
    before = set(glob.glob("/dev/shm/asap-*"))
    mark = str(tmp_path / "killed")
    cfg = RuntimeConfig(num_attention_ranks=2, num_expert_ranks=2, spare_expert_ranks=1, token_budget=32,
                        chunk_len=16, max_prompt_len=64, timeout_s=90)
    requests = make_trace(30, seed=2, spread_s=1.0)
    result = run_async(KillFirstHolder(20, mark), INFO, requests, cfg)
    assert os.path.exists(mark), "the expert PE was never killed: the run did not test failover"
    failed = {rec.request_id: rec.error for rec in result.records if not rec.ok}
    assert failed == {}, failed
    assert sorted(result.outputs) == [r.request_id for r in requests]
    assert check_against_reference(requests, result) == []
    # a group's segments are named asap-<12 hex>-...; others (another run's, a store's) may come and go meanwhile
    _wait(lambda: not {p for p in set(glob.glob("/dev/shm/asap-*")) - before if LAUNCH_SEGMENT.match(p)}, 10,
          "the group's shared-memory segments to be removed")


class KillFirstAttention:
    """Builds the tiny model's halves; the attention PE that *first* passes ``after`` attention stages SIGKILLs itself
    there (a file created with O_EXCL marks it, so the survivor, which then runs its requests, lives)."""

    def __init__(self, after: int, mark: str) -> None:
        self.after, self.mark, self.inner = after, mark, TinyFactory()

    def __call__(self, role: str, experts: list):
        model = self.inner(role, experts)
        if role != "attention":
            return model
        calls, inner, after, mark = [0], model.attention_stage, self.after, self.mark

        def attention_stage(layer, hidden, cache=None):
            calls[0] += 1
            if calls[0] > after:
                try:
                    os.close(os.open(mark, os.O_CREAT | os.O_EXCL))
                except FileExistsError:
                    pass
                else:
                    os.kill(os.getpid(), signal.SIGKILL)
            return inner(layer, hidden, cache)

        model.attention_stage = attention_stage
        return model


def test_front_end_readmits_a_dead_attention_ranks_requests():
    """The front end's side of attention failover (no processes: a stub group and mailbox): attention PE 0 dies;
    its requests, a lane through it among them, are queued again on PE 1 under new wire ids, the lane's other rank
    gets a cancel for the old one, no lane opens any more, a result under a new id answers its request, and the
    last attention PE's death fails the group."""
    class _Comm:
        world_size, rank, states = 5, 4, {}

        def peer_state(self, pe):
            return self.states.get(pe, "alive")

    class _Msg:
        def __init__(self, tag, src, tensor):
            self.tag, self.src, self.tensor = tag, src, tensor

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class _Box:
        def __init__(self):
            self.inbox = deque()

        def poll(self):
            return self.inbox.popleft() if self.inbox else None

        def send(self, pe, payload, tag, timeout=None):  # every inbox has room
            pass

    comm, box = _Comm(), _Box()
    cfg = RuntimeConfig(num_attention_ranks=2, num_expert_ranks=2, attention_failover=True, token_budget=32,
                        chunk_len=16, max_prompt_len=128, timeout_s=90)
    fe = FrontEnd(comm, cfg, INFO, box, 2, "async")
    toks = torch.arange(40) % CFG.vocab_size
    fe.admit(0, toks)  # 3 chunks: the lane over ranks 0 and 1
    for rid, n in ((1, 10), (2, 12), (3, 8), (4, 9)):
        fe.admit(rid, toks[:n])
    assert fe.inflight[0].lane == (0, 1)
    on0 = sorted(r for r, a in fe.inflight.items() if not a.lane and a.rank == 0)
    on1 = sorted(r for r, a in fe.inflight.items() if not a.lane and a.rank == 1)
    assert on0 and on1, (on0, on1)
    for q in fe.pending:  # as if every chunk had reached its rank
        q.clear()
    for a in fe.inflight.values():
        a.unsent = 0
    comm.states[0] = "died"
    assert fe._attention_check(force=True) == []
    assert fe.attention.dead == {0: "died"} and fe.attention.readmissions == 1 + len(on0)
    assert not fe.pending[0] and fe.placer.ranks == [1] and not fe.lane.pool.spans
    queued = list(fe.pending[1])
    assert queued[0][2] == CANCEL and decode_cancel(queued[0][1]) == 0  # the lane's old attempt, on its live rank
    wires = {}
    for rid, payload, tag, _ in queued[1:]:
        chunk = decode_chunk(payload)[0]
        assert chunk.request_id >= READMIT_BASE and fe.alias[chunk.request_id] == rid and fe.inflight[rid].rank == 1
        wires[rid] = chunk.request_id
    assert sorted(wires) == [0] + on0 and all(fe.inflight[r].wire == r for r in on1)
    assert fe.admit(5, toks) == 1 and not fe.inflight[5].lane  # one rank left: no lane
    box.inbox.append(_Msg(wires[0], 1, encode_result(torch.zeros(CFG.hidden_size), 7)))
    done = fe.pump()
    assert [(c.request_id, c.token) for c in done] == [(0, 7)] and 0 not in fe.inflight
    assert wires[0] not in fe.alias
    comm.states[1] = "died"
    with pytest.raises(PeerFailure, match="no other attention rank"):
        fe._attention_check(force=True)


def test_a_request_in_flight_at_a_second_attention_death_fails_alone():
    """A request is re-admitted at most READMIT_LIMIT (1) time: one that was on the attention PE that died first
    and again on the next one to die fails alone (an error result, 503 in the service: it may be what kills the
    PEs), while the second PE's own requests are re-admitted and the group goes on with its last PE."""
    class _Comm:
        world_size, rank, states = 6, 5, {}

        def peer_state(self, pe):
            return self.states.get(pe, "alive")

    class _Box:
        def poll(self):
            return None

        def send(self, pe, payload, tag, timeout=None):
            pass

    comm = _Comm()
    cfg = RuntimeConfig(num_attention_ranks=3, num_expert_ranks=2, attention_failover=True, token_budget=32,
                        chunk_len=16, max_prompt_len=128, timeout_s=90)
    fe = FrontEnd(comm, cfg, INFO, _Box(), 3, "async")
    toks = torch.arange(12) % CFG.vocab_size
    for rid in range(9):
        fe.admit(rid, toks[:6 + rid % 5])
    assert all(not a.lane for a in fe.inflight.values())
    for q in fe.pending:
        q.clear()
    for a in fe.inflight.values():
        a.unsent = 0
    on = {pe: sorted(r for r, a in fe.inflight.items() if a.rank == pe) for pe in range(3)}
    assert all(on.values()), on
    comm.states[0] = "died"
    assert fe._attention_check(force=True) == []
    moved = {r: fe.inflight[r].rank for r in on[0]}  # re-admitted once, on PE 1 or 2
    second = moved[on[0][0]]
    twice = sorted(r for r, pe in moved.items() if pe == second)
    for q in fe.pending:
        q.clear()
    for a in fe.inflight.values():
        a.unsent = 0
    comm.states[second] = "died"
    failed = fe._attention_check(force=True)
    assert sorted(c.request_id for c in failed) == twice
    assert all(c.error and "not re-admitted again" in c.error and c.token == -1 for c in failed)
    assert not any(r in fe.inflight for r in twice)
    last = ({1, 2} - {second}).pop()
    assert all(fe.inflight[r].rank == last for r in on[second])  # the second PE's own: re-admitted once
    assert fe.attention.readmissions == len(on[0]) + len(on[second])


def test_run_async_loses_nothing_when_an_attention_pe_dies(tmp_path, capfd):
    """Attention failover: a SIGKILLed attention PE's requests (lane prompts through it among them: prompts over
    16 tokens take the lane) are re-admitted on the other attention rank; every answer equals the reference."""
    mark = str(tmp_path / "killed")
    cfg = RuntimeConfig(num_attention_ranks=2, num_expert_ranks=2, attention_failover=True, token_budget=32,
                        chunk_len=16, max_prompt_len=64, timeout_s=90)
    requests = make_trace(30, seed=3, spread_s=1.0)
    result = run_async(KillFirstAttention(40, mark), INFO, requests, cfg)
    assert os.path.exists(mark), "the attention PE was never killed: the run did not test failover"
    failed = {rec.request_id: rec.error for rec in result.records if not rec.ok}
    assert failed == {}, failed
    assert sorted(result.outputs) == [r.request_id for r in requests]
    assert check_against_reference(requests, result) == []
    err = capfd.readouterr().err
    said = re.findall(r"failover: attention worker PE (\d) died; (\d+) request\(s\) re-admitted", err)
    assert len(said) == 1 and int(said[0][1]) > 0, err[-3000:]


def _prompt(g: torch.Generator) -> list:
    n = int(torch.randint(4, 60, (1,), generator=g))
    return torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist()


class Load:
    """``clients`` threads, each calling /v1/completions one call after another (hidden states asked for) until
    stopped; every answer kept as (prompt, status, body)."""

    def __init__(self, url: str, clients: int) -> None:
        self.url, self.answers, self.stop_flag = url, [], threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]
        for t in self.threads:
            t.start()

    def _client(self, i: int) -> None:
        g = torch.Generator().manual_seed(1000 + i)
        with httpx.Client(base_url=self.url, timeout=90) as http:
            while not self.stop_flag.is_set():
                ids = _prompt(g)
                try:
                    r = http.post("/v1/completions", json={"prompt": ids, "return_hidden_states": True})
                    answer = (ids, r.status_code, r.json())
                except (httpx.HTTPError, ValueError) as e:
                    answer = (ids, 0, {"error": f"{type(e).__name__}: {e}"})
                with self.lock:
                    self.answers.append(answer)

    def count(self) -> int:
        with self.lock:
            return len(self.answers)

    def stop(self) -> list:
        self.stop_flag.set()
        for t in self.threads:
            t.join(timeout=JOIN_S)
        assert not any(t.is_alive() for t in self.threads), "a load thread did not end"
        return list(self.answers)


def _wait(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"waited {timeout_s} s for {what}"
        time.sleep(0.05)


def _bad_answers(answers: list) -> list:
    """The answers that are not 200 with the reference's first token and hidden state."""
    model = random_init(CFG, seed=0)
    bad = []
    for ids, code, body in answers:
        if code != 200:
            bad.append((code, body))
            continue
        out = model.prefill(torch.tensor(ids, dtype=torch.int64))
        choice = body["choices"][0]
        if choice["token_ids"] != [int(out.logits[-1].argmax())] or not torch.allclose(
                torch.tensor(choice["hidden_states"]), out.final_hidden[-1], rtol=1e-4, atol=1e-5):
            bad.append(("wrong", ids))
    return bad


def test_service_fails_over_under_load_then_fails_when_no_spare_is_left():
    s = Service(["--model", "tiny", "--spare-expert-ranks", "1", "--failure-exit-s", "2", "--chunk-len", "32",
                 "--token-budget", "64"], start_timeout_s=240, cwd=REPO)
    try:
        status, health = s.health()
        assert status == 200 and health["failover"]["spares_left"] == [4], health
        workers = health["workers"]
        assert [w["role"] for w in workers] == ["attention worker"] * 2 + ["expert worker"] * 2 + \
            ["spare expert worker"]
        assert [w["expert_rank"] for w in workers[2:]] == [0, 1, None]
        assert s.metric("asap_expert_failovers_total") == 0
        victim = workers[2]
        load = Load(s.url, clients=4)
        try:
            _wait(lambda: load.count() >= 8, 60, "the load to be answered")
            os.kill(victim["pid"], signal.SIGKILL)
            _wait(lambda: s.metric("asap_expert_failovers_total") == 1, 30, "the failover")
            served = load.count()
            _wait(lambda: load.count() >= served + 12, 60, "answers after the failover")
        finally:
            answers = load.stop()
        # every call answered 200 with the reference's token and hidden state
        bad = _bad_answers(answers)
        assert bad == [] and len(answers) >= 20, (bad[:5], len(answers), s.log()[-3000:])
        # /health: healthy, the dead PE replaced by the spare, which serves its expert rank
        status, health = s.health()
        assert status == 200, health
        fo = health["failover"]
        assert fo["failovers"] == 1 and fo["spares_left"] == [] and fo["expert_rank_pes"] == [4, 3]
        assert [(e["expert_rank"], e["dead_pe"], e["new_pe"]) for e in fo["replacements"]] == [(0, 2, 4)]
        w = {x["pe"]: x for x in health["workers"]}
        assert w[2]["state"] == "died" and w[2]["replaced_by"] == 4 and w[4]["expert_rank"] == 0
        assert s.metric("asap_spare_expert_ranks_left") == 0
        assert "spare PE 4 takes over expert rank 0" in s.log()
        # no spare left: the next expert death fails the service as before (503 naming it, exit 3)
        os.kill(w[4]["pid"], signal.SIGKILL)
        status, health = s.wait_health(lambda st, b: st == 503, 30)
        assert status == 503 and "PE 4 died" in health["error"], health
        r = s.client.post("/v1/completions", json={"prompt": [1, 2, 3]})
        assert r.status_code == 503 and "PE 4 died" in r.json()["error"]["message"], r.text
        assert s.proc.wait(timeout=60) == 3, s.log()[-3000:]
        assert wait_dead([x["pid"] for x in workers]) == []
        assert s.new_segments() == set()
    finally:
        s.close()


def test_service_survives_an_attention_pe_killed_under_load():
    """--attention-failover: SIGKILL of attention PE 0 under load; its requests are re-admitted on PE 1, every call
    is answered 200 with the reference's answer, /health stays 200 and shows the loss, /metrics counts it, and a
    stop after it is clean (exit 0)."""
    s = Service(["--model", "tiny", "--attention-failover", "--chunk-len", "32", "--token-budget", "64"],
                start_timeout_s=240, cwd=REPO)
    try:
        status, health = s.health()
        assert status == 200 and health["attention_failover"]["live"] == [0, 1], health
        assert s.metric("asap_attention_failovers_total") == 0
        workers = health["workers"]
        load = Load(s.url, clients=6)
        try:
            _wait(lambda: load.count() >= 8, 60, "the load to be answered")
            os.kill(workers[0]["pid"], signal.SIGKILL)
            _wait(lambda: s.metric("asap_attention_failovers_total") == 1, 30, "the attention failover")
            served = load.count()
            _wait(lambda: load.count() >= served + 12, 60, "answers after the failover")
        finally:
            answers = load.stop()
        bad = _bad_answers(answers)
        assert bad == [] and len(answers) >= 20, (bad[:5], len(answers), s.log()[-3000:])
        status, health = s.health()
        assert status == 200, health
        at = health["attention_failover"]
        assert at["failovers"] == 1 and at["live"] == [1] and [e["pe"] for e in at["losses"]] == [0], at
        w = {x["pe"]: x for x in health["workers"]}
        assert w[0]["state"] == "died" and w[0]["failed_over"] and not w[1]["failed_over"], w
        # 6 clients with a call each in flight on 2 ranks (lane prompts on both): PE 0 held some when it died
        readmitted = s.metric("asap_attention_readmissions_total")
        assert readmitted == at["readmissions"] == w[0]["readmitted"] >= 1, (readmitted, at)
        assert "failover: attention worker PE 0 died" in s.log()
        assert s.close() == 0, s.log()[-3000:]
        assert wait_dead([x["pid"] for x in workers]) == []
        assert s.new_segments() == set()
    finally:
        s.close()
