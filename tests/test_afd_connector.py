"""asap_comm.afd.AsapAFDConnector driven the way vLLM afd-plugin drives a connector, by a small two-role engine.

Attention side (two data-parallel replicas): per forward pass, the tokens are split into two stages
(``ubatch_idx`` 0 and 1); per layer and stage, attention and routing, ``send_attn_output`` with the routing,
and the stage's previous-layer output taken with ``recv_ffn_output`` just before its next attention: stage 1
goes out before stage 0 comes back (ping-pong), as the plugin's asynchronous forward does. FFN side (two
ranks, four routed experts each): ``recv_attn_output``, its own experts computed from the payload's routing,
``send_ffn_output``, until every replica has closed. Every forward pass is checked against the same model
computed on one process.

Replica 0 stops after its first send and waits until replica 1 has run all its forward passes: if the
connector made the replicas wait for each other this would never end (a bounded wait fails the test).

On one host (each process forms the group itself from ``afd_config`` host and port, as the plugin's
``init_afd_connector`` would), and across two network-namespace hosts (UCX between them).
"""
import multiprocessing as mp
import os
import socket
import time
from types import SimpleNamespace

import pytest
import torch

from asap_comm.afd import AFDTransferContext, AFDTransferMetadata, AsapAFDConnector, AsapExtraInfo

H, N, K, LAYERS, A, F = 16, 8, 2, 3, 2, 2
STEPS = {0: [5, 12, 1], 1: [9, 3, 16, 7, 2]}  # tokens of each forward pass, per replica
GATE_TIMEOUT_S = 40.0


def weights():
    g = torch.Generator().manual_seed(0)
    attn = [torch.randn(H, H, generator=g) / H ** 0.5 for _ in range(LAYERS)]
    router = [torch.randn(H, N, generator=g) for _ in range(LAYERS)]
    experts = [[torch.randn(H, H, generator=g) / H ** 0.5 for _ in range(N)] for _ in range(LAYERS)]
    return attn, router, experts


def attention(attn, router, layer, h):
    h = h + torch.tanh(h @ attn[layer])
    w, ids = torch.softmax(h @ router[layer], -1).topk(K)
    return h, ids, w


def reference(x):
    """The whole model on one process."""
    attn, router, experts = weights()
    for layer in range(LAYERS):
        x, ids, w = attention(attn, router, layer, x)
        y = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(K):
                y[t] += w[t, j] * torch.relu(x[t] @ experts[layer][int(ids[t, j])])
        x = x + y
    return x


def configs(role: str, host: str, port: int, extra: "dict | None" = None):
    afd = {"role": role, "connector": "AsapAFDConnector", "num_attention_ranks": A, "num_ffn_ranks": F,
           "host": host, "port": port, "connector_extra_config": extra or {"num_ubatches": 2, "timeout_s": 30}}
    hf = SimpleNamespace(hidden_size=H, n_routed_experts=N, num_experts_per_tok=K)
    vllm = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf, dtype=torch.float32),
                           scheduler_config=SimpleNamespace(max_num_batched_tokens=16),
                           additional_config={"afd": afd})
    return vllm, afd


def attention_engine(conn, replica: int, gate) -> dict:
    attn, router, _ = weights()
    problems, inflight_max = [], 0
    if replica == 1:  # bad calls first: a clear error and nothing sent
        ctx = AFDTransferContext(AFDTransferMetadata(0, 0, [2]))
        ids, w = torch.zeros(3, K, dtype=torch.long), torch.ones(3, K)
        for call, want in ((lambda: conn.send_attn_output(torch.zeros(2, H), ctx), ValueError),  # no routing
                           (lambda: conn.send_attn_output(torch.zeros(3, H), ctx, topk_ids=ids, topk_weights=w),
                            ValueError),  # 3 rows, the metadata says 2
                           (lambda: conn.recv_ffn_output(torch.zeros(2, H), ubatch_idx=0), RuntimeError),
                           (lambda: conn.recv_attn_output(), RuntimeError)):
            try:
                call()
                problems.append(f"no {want.__name__}")
            except want:
                pass
    g = torch.Generator().manual_seed(100 + replica)
    for step, tokens in enumerate(STEPS[replica]):
        x = torch.randn(tokens, H, generator=g)
        cut = (tokens + 1) // 2
        stages = [x[:cut], x[cut:]] if tokens > 1 else [x]
        pending = [False] * len(stages)
        for layer in range(LAYERS):
            for s in range(len(stages)):
                if pending[s]:  # the previous layer's FFN output of this stage, just before its next attention
                    stages[s] = stages[s] + conn.recv_ffn_output(stages[s], ubatch_idx=s)
                h, ids, w = attention(attn, router, layer, stages[s])
                ctx = AFDTransferContext(AFDTransferMetadata.create_attention_metadata(
                    layer_idx=layer, stage_idx=s, seq_len=h.shape[0]))
                conn.send_attn_output(h, ctx, topk_ids=ids, topk_weights=w)
                stages[s], pending[s] = h, True
                inflight_max = max(inflight_max, sum(len(q) for q in conn._pending.values()))
                if replica == 0 and step == 0 and layer == 0 and s == 0:  # wait for all of replica 1's passes
                    conn.comm.signal_wait_until(gate, 0, ">=", 1, timeout=GATE_TIMEOUT_S)
        for s in range(len(stages)):
            stages[s] = stages[s] + conn.recv_ffn_output(stages[s], ubatch_idx=s)
        err = float((torch.cat(stages) - reference(x)).abs().max())
        if not err < 1e-5:
            problems.append(f"replica {replica} step {step}: max |connector - reference| = {err}")
    if replica == 1:
        conn.comm.signal_op(gate, 0, 1, "set", 0)
    return {"problems": problems, "steps": len(STEPS[replica]), "inflight_max": inflight_max}


def ffn_engine(conn) -> dict:
    _, _, experts = weights()
    mine = conn.local_experts
    seen, rows = set(), 0
    while (payload := conn.recv_attn_output()) is not None:
        x, meta, st = payload.hidden_states, payload.context.metadata, payload.context.states
        assert meta.validate_tensor_shape(tuple(x.shape)) and st.topk_ids.shape == (x.shape[0], K)
        # FFN rank 1 computes in place where the rows go back (ffn_output_buffer), rank 0 into a tensor of its own
        out = conn.ffn_output_buffer(payload.context).zero_() if conn.role_rank == 1 else torch.zeros_like(x)
        for e in mine:  # this rank's experts, weighted; ids elsewhere are -1
            t, j = (st.topk_ids == e).nonzero(as_tuple=True)
            out.index_add_(0, t, st.topk_weights[t, j, None] * torch.relu(x[t] @ experts[meta.layer_idx][e]))
        assert not ((st.topk_ids >= 0) & ~torch.isin(st.topk_ids, torch.tensor(mine))).any()
        conn.send_ffn_output(out, payload.context)
        seen.add((st.source, meta.stage_idx))
        rows += x.shape[0]
    return {"experts": mine, "seen": sorted(seen), "rows": rows}


def run_pe(conn) -> dict:
    conn.init_afd_connector()
    gate = conn.comm.signals(1)  # collective: every PE allocates it, in the same order
    hosts = list(conn.comm.hosts)
    try:
        res = attention_engine(conn, conn.role_rank, gate) if conn.role == "attention" else ffn_engine(conn)
    finally:
        conn.close()
    assert not conn.is_initialized and conn.comm is None  # close() left the group it formed
    return {**res, "hosts": hosts}


def _one_host_pe(role: str, role_rank: int, port: int, q) -> None:
    torch.set_num_threads(1)
    try:
        vllm, afd = configs(role, "127.0.0.1", port)
        conn = AsapAFDConnector(role_rank if role == "attention" else A + role_rank, 0, vllm, afd, role_rank)
        q.put((role, role_rank, "ok", run_pe(conn)))
    except BaseException as e:  # report, then die: the others see a dead peer instead of waiting
        q.put((role, role_rank, "err", f"{type(e).__name__}: {e}"))
        os._exit(1)


def check(results: dict) -> None:
    for r in range(A):
        res = results[("attention", r)]
        assert res["problems"] == [], res["problems"]
        assert res["steps"] == len(STEPS[r]) and res["inflight_max"] >= 2  # two stages out at once
    held = []
    for r in range(F):
        res = results[("ffn", r)]
        held += res["experts"]
        # every FFN rank served both replicas and both stages (the routing spreads every pass over all experts)
        assert {s for s, _ in res["seen"]} == {0, 1} and {st for _, st in res["seen"]} == {0, 1}, res["seen"]
        assert res["rows"] > 0
    assert sorted(held) == list(range(N)) and results[("ffn", 0)]["experts"] == [0, 1, 2, 3]


@pytest.mark.slow
def test_two_role_engine_on_one_host():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_one_host_pe, args=(role, r, port, q), daemon=True)
             for role, n in (("attention", A), ("ffn", F)) for r in range(n)]
    for p in procs:
        p.start()
    results, deadline = {}, time.monotonic() + 90
    try:
        while len(results) < len(procs):
            role, r, status, value = q.get(timeout=max(0.1, deadline - time.monotonic()))
            assert status == "ok", f"{role} {r}: {value}"
            results[(role, r)] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    check(results)


def test_configuration_errors_name_the_field():
    vllm, afd = configs("attention", "127.0.0.1", 1)
    conn = AsapAFDConnector(0, 0, vllm, afd, 1)
    assert (conn.world_rank, conn.attn_size, conn.ffn_size, conn.control_plane) == (1, A, F, None)
    assert not conn.is_initialized and conn.plan.max_inflight == 2 and conn.plan.max_tokens == 16
    with pytest.raises(RuntimeError, match="not initialized"):
        conn.send_attn_output(torch.zeros(1, H), None)
    with pytest.raises(ValueError, match="role_rank=2 is out of range"):
        AsapAFDConnector(0, 0, vllm, afd, 2)
    with pytest.raises(ValueError, match="afd_config.role='experts'"):
        AsapAFDConnector(0, 0, vllm, {**afd, "role": "experts"}, 0)
    with pytest.raises(ValueError, match=r"unknown connector_extra_config field\(s\) \['dynamicQuant'\]"):
        AsapExtraInfo.from_mapping({"dynamicQuant": 1})
    with pytest.raises(ValueError, match="num_ubatches=0"):
        AsapExtraInfo.from_mapping({"num_ubatches": 0})
    vllm.scheduler_config.max_num_batched_tokens = None
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        AsapAFDConnector(0, 0, vllm, afd, 0)
    vllm.additional_config["afd"]["connector_extra_config"] = {"max_tokens": 64}
    assert AsapAFDConnector(0, 0, vllm, afd, 0).plan.max_tokens == 64
    ffn = AsapAFDConnector(3, 0, configs("ffn", "127.0.0.1", 1)[0], {**afd, "role": "ffn"}, 1)
    assert ffn.world_rank == A + 1 and ffn.local_experts == [4, 5, 6, 7]


def test_init_refuses_a_group_too_small(comm1):
    vllm, afd = configs("attention", "127.0.0.1", 1)
    conn = AsapAFDConnector(0, 0, vllm, afd, 0, comm=comm1)
    with pytest.raises(ValueError, match="must be PE 0 of a group of at least 4"):
        conn.init_afd_connector()
    assert not conn.is_initialized


# --------------------------------------------------------------------------- across hosts
def _across_hosts_pe(comm) -> dict:
    """On a simulated host: the connector forms its own group at the first host's address (port + 1), as
    ``init_afd_connector`` does in the plugin; ``comm`` (the harness's group) only says who this PE is."""
    role = "attention" if comm.rank < A else "ffn"
    role_rank = comm.rank if role == "attention" else comm.rank - A
    vllm, afd = configs(role, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1)
    conn = AsapAFDConnector(comm.rank, comm.local_rank, vllm, afd, role_rank)
    return {"role": role, "role_rank": role_rank, "result": run_pe(conn)}


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.parametrize("layout", [[2, 2], [3, 1]], ids=["2A|2F", "2A+1F|1F"])
def test_two_role_engine_across_two_hosts(layout):
    from asap_comm.testing.netns import Hosts, run_across_hosts

    with Hosts(2) as hosts:
        out = run_across_hosts(hosts, layout, _across_hosts_pe, timeout=120)
        names = [h.hostname for h in hosts.hosts]
    # the connector's own group spans both hosts, PEs in the layout's order
    assert out[0]["result"]["hosts"] == [names[h] for h, n in enumerate(layout) for _ in range(n)]
    check({(o["role"], o["role_rank"]): o["result"] for o in out})
