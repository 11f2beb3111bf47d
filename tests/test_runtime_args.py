"""One name per concept: the runtime's flags are declared once (``serving.runtime_args``) with RuntimeConfig's
defaults and every command line takes them; the configuration's shared and per-mode parts; the lane's wait bound
in seconds under one name; the automatic SLO rule in one function (``serving.slo.auto_slo``)."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from asap_comm.serving.protocol import ASYNC_FIELDS, SHARED_FIELDS, SYNC_FIELDS, RuntimeConfig
from asap_comm.serving.runtime_args import FLAGS, add_runtime_args, given_flags, runtime_config_from_args
from asap_comm.serving.slo import SLO_MULTIPLIER, auto_slo, p90_prompt_len

# a value other than the default for every value flag (the switches are --no-<name>: given, the field is False)
OTHER = {"num_attention_ranks": 3, "num_expert_ranks": 5, "token_budget": 96, "max_prompt_len": 4000,
         "chunk_len": 48, "expert_token_budget": 77, "expert_deadline_s": 0.25, "lane_threshold": 300,
         "lane_groups": 2, "lane_tokens": 1234, "lane_wait_s": 1.5, "lane_chunks": "cost", "spare_expert_ranks": 1,
         "sync_collectives": "shm"}
# the switches that are off by default (--<name>: given, the field is True)
SWITCHES = {"attention_failover"}
# fields a command sets itself, not a flag of the runtime's (the run's bound and progress line, the placer's weight
# from a cost model, the baseline's context parallelism that only modelled devices have, the HTTP service's urgent
# slot that only the server turns on, with its own --no-urgent-slot)
NOT_FLAGS = {"timeout_s", "progress", "placer_linear_weight", "cp_threshold", "urgent_slot"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_runtime_args(p)
    return p


def _parsers() -> dict:
    """Every command line that builds a RuntimeConfig from flags, by name."""
    from asap_comm.serving.server.cli import build_parser as server
    from asap_comm.sim.emulate.deploy import build_parser as example

    return {"add_runtime_args": _parser(), "server": server(), "examples/prefill.py": example()}


def test_every_field_has_one_flag_and_every_flag_reaches_its_field():
    fields = {f.name for f in dataclasses.fields(RuntimeConfig)}
    assert set(FLAGS) == fields - NOT_FLAGS
    for name, flag in FLAGS.items():
        if flag.startswith("--no-"):
            argv, want = [flag], False
            assert getattr(RuntimeConfig(), name) is True, name  # a switch that is on by default
        elif name in SWITCHES:
            argv, want = [flag], True
            assert getattr(RuntimeConfig(), name) is False, name
        else:
            argv, want = [flag, str(OTHER[name])], OTHER[name]
            assert getattr(RuntimeConfig(), name) != want, name
        cfg = runtime_config_from_args(_parser().parse_args(argv))
        assert getattr(cfg, name) == want, (flag, getattr(cfg, name))
        changed = {f for f in fields if getattr(cfg, f) != getattr(RuntimeConfig(), f)}
        assert changed == {name}, (flag, changed)


def test_every_command_line_has_the_dataclass_defaults():
    """One set of defaults: with no flags, each command line's configuration is RuntimeConfig(), but for the
    service's one preset (the baseline's collectives on asap_comm, not gloo's jammable loopback store)."""
    from asap_comm.serving.server.cli import SERVICE_PRESETS

    assert SERVICE_PRESETS == {"sync_collectives": "shm"}
    for name, p in _parsers().items():
        want = RuntimeConfig(**SERVICE_PRESETS) if name == "server" else RuntimeConfig()
        assert runtime_config_from_args(p.parse_args([])) == want, name
    assert (RuntimeConfig.token_budget, RuntimeConfig.chunk_len, RuntimeConfig.max_prompt_len) == (256, 256, 8192)


def test_the_lane_wait_bound_is_one_name_in_seconds_on_every_command_line():
    for name, p in _parsers().items():
        options = {o for a in p._actions for o in a.option_strings}
        assert "--lane-wait-s" in options and "--lane-wait" not in options, name
        assert runtime_config_from_args(p.parse_args(["--lane-wait-s", "2.5"])).lane_wait_s == 2.5, name
    # the multiples of the SLO are their own, clearly named flags: the example's and headline's --lane-wait-slo
    from asap_comm.sim.emulate.deploy import build_parser, lane_wait_s

    a = build_parser().parse_args([])
    assert (a.lane_wait_s, a.lane_wait_slo) == (None, 2.0) and lane_wait_s(a, 3.0) == 6.0
    assert lane_wait_s(build_parser().parse_args(["--lane-wait-slo", "none"]), 3.0) is None
    assert lane_wait_s(build_parser().parse_args(["--lane-wait-s", "0.5"]), 3.0) == 0.5  # seconds win
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--lane-wait", "1"])  # which unit? refused (ambiguous)


def test_bad_values_name_the_flag_and_the_value():
    p = _parser()
    for argv, words in ((["--token-budget", "0"], "--token-budget 0:"),
                        (["--lane-wait-s", "-1"], "--lane-wait-s -1.0:"),
                        (["--lane-groups", "1"], "--lane-groups 1:"), (["--lane-tokens", "0"], "--lane-tokens 0:"),
                        (["--expert-deadline-s", "nan"], "--expert-deadline-s nan:")):
        with pytest.raises(ValueError) as e:
            runtime_config_from_args(p.parse_args(argv))
        assert str(e.value).startswith(words), str(e.value)
    with pytest.raises(ValueError, match="--lane-tokens auto"):  # no memory model here to size the pool
        runtime_config_from_args(p.parse_args(["--lane-tokens", "auto"]))
    assert runtime_config_from_args(p.parse_args(["--lane-tokens", "auto"]), lane_tokens=64).lane_tokens == 64
    assert runtime_config_from_args(p.parse_args(["--lane-threshold", "auto"])).lane_threshold is None
    with pytest.raises(SystemExit):
        p.parse_args(["--lane-tokens", "many"])
    # an override the command set itself keeps its field's name
    with pytest.raises(ValueError, match="RuntimeConfig: token_budget=0"):
        runtime_config_from_args(p.parse_args([]), token_budget=0)


def test_given_flags_sees_both_spellings():
    p = _parser()
    assert given_flags(p, ["--token-budget", "9", "--chunk-len=4", "--no-ping-pong", "x"]) == {
        "token_budget", "chunk_len", "no_ping_pong"}


def test_the_configuration_has_a_shared_part_and_one_part_per_mode():
    names = [f.name for f in dataclasses.fields(RuntimeConfig)]
    assert sorted(SHARED_FIELDS + ASYNC_FIELDS + SYNC_FIELDS) == sorted(names)
    assert not set(SHARED_FIELDS) & set(ASYNC_FIELDS) and not set(ASYNC_FIELDS) & set(SYNC_FIELDS)
    assert set(RuntimeConfig.mode_fields("sync")) == set(SHARED_FIELDS + SYNC_FIELDS)
    both = RuntimeConfig(token_budget=64, ping_pong=False, lane_wait_s=1.0, sync_collectives="shm", cp_threshold=32)
    a, s = both.for_mode("async"), both.for_mode("sync")
    assert (a.token_budget, a.ping_pong, a.lane_wait_s, a.sync_collectives, a.cp_threshold) == (64, False, 1.0,
                                                                                              "gloo", None)
    assert (s.token_budget, s.ping_pong, s.lane_wait_s, s.sync_collectives, s.cp_threshold) == (64, True, None,
                                                                                              "shm", 32)
    with pytest.raises(ValueError, match="mode='both'"):
        RuntimeConfig.mode_fields("both")


def test_the_automatic_slo_rule():
    seen = []
    lens = [10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
    r = auto_slo(lens, lambda n: seen.append(n) or 0.5)
    assert seen == [100] and r.p90_prompt_tokens == 100  # the nearest rank at or above the 90th percentile
    assert (r.ttft_s, r.unloaded_ttft_s, r.multiplier) == (SLO_MULTIPLIER * 0.5, 0.5, 3.0)
    assert p90_prompt_len(lens + [5] * 10) == 90 and p90_prompt_len(lens, max_prompt_len=64) == 64
    assert auto_slo(lens, lambda n: 2.0, multiplier=1.0).ttft_s == 2.0
    for bad in (0.0, float("nan"), None):
        with pytest.raises(ValueError, match="auto_slo"):
            auto_slo(lens, lambda n, b=bad: b)
    with pytest.raises(ValueError, match="no prompt lengths"):
        p90_prompt_len([])


def test_the_simulators_slo_is_the_same_rule():
    """sim.study.unloaded_slo and the example's resolve_slo go through auto_slo: the p90 prompt it picks (clipped
    at max_prompt_len) is the one simulated, times 3."""
    from asap_comm.serving.traces import Request
    from asap_comm.sim.core.simulate import simulate
    from asap_comm.sim.core.sweep import unloaded_slo
    from asap_comm.sim.costmodel.costs import CostModel
    from asap_comm.sim.costmodel.shapes import ModelShapes

    cost, shapes = CostModel.load("h800-node", "tiny"), ModelShapes.load("tiny")
    trace = [Request(i, 0.1 * i, n) for i, n in enumerate([40, 80, 120, 160, 200, 240, 280, 320, 360, 900])]
    cfg = RuntimeConfig(max_prompt_len=600)
    one = simulate("sync", [Request(0, 0.0, 600)], cost, shapes, cfg).records[0].ttft_s
    assert unloaded_slo(trace, cost, shapes, cfg) == pytest.approx(SLO_MULTIPLIER * one)
