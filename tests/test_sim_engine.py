"""The simulator's event engine: time order, FIFO ties, cancellation, processor sharing, serial ranks."""
import pytest

from asap_comm.sim.core.engine import Engine, Host, Rank, ps_makespan


def test_events_run_in_time_order_and_ties_in_scheduling_order():
    eng, seen = Engine(), []
    for t, name in [(2.0, "c"), (1.0, "a"), (2.0, "d"), (1.0, "b"), (0.5, "first")]:
        eng.at(t, seen.append, name)
    eng.after(2.0, seen.append, "e")  # same time as c, d: after them (scheduled later)
    assert eng.run() == 2.0
    assert seen == ["first", "a", "b", "c", "d", "e"]
    assert eng.events == 6


def test_events_scheduled_while_running_and_cancellation():
    eng, seen = Engine(), []

    def chain(n):
        seen.append((eng.now, n))
        if n < 3:
            eng.after(0.25, chain, n + 1)
    eng.at(1.0, chain, 0)
    h = eng.at(1.3, seen.append, "cancelled")
    Engine.cancel(h)
    eng.run()
    assert seen == [(1.0, 0), (1.25, 1), (1.5, 2), (1.75, 3)]
    assert eng.pending == 0


def test_run_until_stops_at_the_horizon():
    eng, seen = Engine(), []
    eng.at(1.0, seen.append, 1)
    eng.at(3.0, seen.append, 3)
    assert eng.run(until=2.0) == 2.0 and seen == [1]
    eng.run()
    assert seen == [1, 3]


@pytest.mark.parametrize("bad", [-1.0, float("nan")])
def test_scheduling_in_the_past_or_at_nan_is_an_error(bad):
    eng = Engine()
    eng.at(1.0, lambda: None)
    eng.run()
    with pytest.raises(ValueError, match="Engine.at"):
        eng.at(bad, lambda: None)
    with pytest.raises(ValueError, match="Engine.after"):
        eng.after(-0.5, lambda: None)


def test_processor_sharing_host():
    # one core, jobs of 1 s and 2 s started together: both at rate 1/2 until the first ends at 2 s,
    # then the second alone: it has 1 s left, so it ends at 3 s.
    eng = Engine()
    host = Host(eng, cores=1)
    done = {}
    host.run(1.0, lambda: done.setdefault("a", eng.now))
    host.run(2.0, lambda: done.setdefault("b", eng.now))
    eng.run()
    assert done == pytest.approx({"a": 2.0, "b": 3.0})
    # a job arriving later shares from then on: 2 cores, 3 jobs of 1 s at t=0 -> rate 2/3 -> all end at 1.5 s
    eng = Engine()
    host = Host(eng, cores=2)
    ends = []
    for _ in range(3):
        host.run(1.0, lambda: ends.append(eng.now))
    eng.run()
    assert ends == pytest.approx([1.5, 1.5, 1.5])
    # weight: one job standing for 3 identical ones behaves the same
    eng = Engine()
    host = Host(eng, cores=2)
    ends = []
    host.run(1.0, lambda: ends.append(eng.now), weight=3)
    eng.run()
    assert ends == pytest.approx([1.5])


def test_dedicated_host_and_ps_makespan_agree_with_the_host():
    eng = Engine()
    host = Host(eng, cores=None)
    ends = []
    for w in (0.5, 2.0, 1.0):
        host.run(w, lambda: ends.append(eng.now))
    eng.run()
    assert ends == [0.5, 1.0, 2.0]
    assert ps_makespan([0.5, 2.0, 1.0], None) == 2.0
    for works, cores in [([1.0, 2.0], 1), ([1.0, 1.0, 1.0], 2), ([0.3, 0.7, 1.1, 2.0, 0.1], 2)]:
        eng, host, ends = Engine(), None, []
        host = Host(eng, cores)
        for w in works:
            host.run(w, lambda: ends.append(eng.now))
        eng.run()
        assert ps_makespan(works, cores) == pytest.approx(max(ends))
    with pytest.raises(ValueError, match="cores"):
        Host(Engine(), cores=0)


def test_rank_runs_jobs_one_at_a_time_in_fifo_order_and_front_jumps_the_queue():
    eng = Engine()
    spans = []
    rank = Rank(eng, Host(eng, None), "r0", spans=spans)
    order = []
    rank.submit(1.0, lambda: (order.append("a"), rank.submit(0.5, lambda: order.append("a2"), "a2", front=True)),
                "a")
    rank.submit(1.0, lambda: order.append("b"), "b")
    eng.run()
    assert order == ["a", "a2", "b"]
    assert [(n, lbl, s, d) for n, lbl, s, d in spans] == [("r0", "a", 0.0, 1.0), ("r0", "a2", 1.0, 0.5),
                                                          ("r0", "b", 1.5, 1.0)]
    assert rank.busy_s == pytest.approx(2.5) and rank.jobs == 3
