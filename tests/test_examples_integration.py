"""The ways in for another engine, run as a user runs them: ``examples/moe_dispatch_combine.py`` (own forward pass,
asap_comm.moe between attention and expert PEs, checked against the local forward) and ``examples/custom_model.py``
(a model that is not DeepseekV3 served by ``run_async``, checked against its own reference forward); and the model
contract (``asap_comm.serving.model_api``) that both the example's model and the shipped plug-in satisfy."""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import asap_comm.serving as serving
from asap_comm.serving.plugins import model_info_of

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def run_example(name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, "PYTHONPATH": path})


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_moe_dispatch_combine_example_matches_the_local_forward():
    r = run_example("moe_dispatch_combine.py")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    rows = re.findall(r"attention PE (\d): (\d+) tokens, 2 MoE layers, max \|remote - local\| = (\S+)", r.stdout)
    assert [int(pe) for pe, _, _ in rows] == [0, 1], r.stdout
    # PE 1 has 33 tokens: three micro-batches of at most max_tokens=16 in flight at once
    assert [int(n) for _, n, _ in rows] == [20, 33]
    assert all(float(err) < 1e-4 for _, _, err in rows), r.stdout
    assert "OK: dispatch/combine matches the local forward" in r.stdout


def test_moe_example_is_short():
    assert len((EXAMPLES / "moe_dispatch_combine.py").read_text().splitlines()) <= 80


@pytest.mark.slow
def test_custom_model_example_is_served_by_run_async_and_matches_its_reference():
    r = run_example("custom_model.py", "--requests", "10", timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "served 10/10 requests through run_async" in r.stdout and r.stdout.strip().endswith("OK"), r.stdout


def test_custom_model_satisfies_the_contract_and_is_not_deepseek():
    mod = load_example("custom_model")
    factory = mod.ToyFactory(seed=0)
    attention, expert = factory("attention", []), factory("expert", [3, 5])
    assert isinstance(factory, serving.DescribedModelFactory)
    assert isinstance(attention, serving.AttentionStage) and isinstance(expert, serving.ExpertStage)
    assert not isinstance(attention, serving.LaneStage)  # no kv_rows: kv_row_width stays 0, no lane
    info = model_info_of(factory)
    assert info.kv_row_width == 0 and info.moe_layers == (False, True, True) and info.top_k == 2
    assert type(attention).__name__ != "DeepseekV3"
    assert sorted(expert.routed[1]) == [3, 5]  # an expert rank holds only the routed experts it was given
    # chunked prefill through the cache equals the whole prompt at once (what the runtime relies on)
    tokens = torch.arange(30) % mod.VOCAB
    whole = attention.attention_stage(0, attention.embed(tokens), attention.new_cache()).hidden
    cache = attention.new_cache()
    parts = [attention.attention_stage(0, attention.embed(tokens[i:i + 16]), cache).hidden for i in (0, 16)]
    assert torch.allclose(torch.cat(parts), whole, atol=1e-5)


def test_the_shipped_plugin_satisfies_the_contract():
    from models.factory import StageFactory

    factory = StageFactory("tiny", seed=0)
    assert isinstance(factory, serving.ModelFactory) and isinstance(factory, serving.DescribedModelFactory)
    assert isinstance(factory("attention", []), serving.LaneStage)  # MLA: kv_rows / append_kv_rows
    assert isinstance(factory("expert", [0]), serving.ExpertStage)
    assert set(serving.model_api.DESCRIBE_KEYS) <= set(factory.describe())


def test_a_model_missing_a_stage_method_is_not_an_attention_stage():
    class NoRouter:
        def new_cache(self): ...
        def embed(self, token_ids): ...
        def attention_stage(self, layer, hidden, cache): ...
        def shared_experts(self, layer, mlp_input): ...
        def dense_mlp(self, layer, mlp_input): ...
        def final_norm(self, hidden): ...
        def lm_head_logits(self, normed): ...

    assert not isinstance(NoRouter(), serving.AttentionStage)
    NoRouter.route = lambda self, layer, mlp_input: None
    assert isinstance(NoRouter(), serving.AttentionStage)
