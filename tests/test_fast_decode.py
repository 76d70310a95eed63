"""The fast (and compiled) decode step against the plain reference: transformers' uncached forward over
each whole history, and the engine's tokens through transformers' own decode forward."""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import fusion.forward.kv_cache as kv_cache
from fusion.config import SamplingParams, parse_config
from fusion.engine.types import GenerationRequest
from fusion.errors import ConfigError
from fusion.experts.expert import LocalExpert, StepRequest
from fusion.forward.ops import attend
from fusion.forward.llama import DecodeStep, FastDecoder, unsupported_reason
from fusion.fuse.registry import make_rule
from tests.conftest import tiny_config_dict


@pytest.fixture(scope="module")
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


@pytest.fixture(scope="module")
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


@pytest.fixture(scope="module")
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


def _expert(path, decode: str = "fast") -> LocalExpert:
    config = parse_config({"experts": [{"name": "x", "model": str(path), "dtype": "float32", "decode": decode}]})
    return LocalExpert.load(config.experts[0])


def _plain_last_logits(model, histories) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([model(torch.tensor([h], device=model.device)).logits[0, -1] for h in histories])  # (B, V)


@pytest.mark.parametrize("model_name", ["llama", "qwen2", "qwen3", "llama3-rope"])
def test_fast_decode_equals_plain_forwards_batched_and_alone(tiny_dir, qwen_dir, qwen3_dir, llama3_rope_dir,
                                                             monkeypatch, model_name):
    """Sessions of different lengths decoded together (a cohort) and alone, through several buffer
    growths, a divergence (crop) and a prompt chunk, give the logits of an uncached forward."""
    monkeypatch.setattr(kv_cache, "DEFAULT_SPARE", 2)
    paths = {"llama": tiny_dir / "a", "qwen2": qwen_dir, "qwen3": qwen3_dir, "llama3-rope": llama3_rope_dir}
    expert = _expert(paths[model_name])
    assert expert._fast_step is not None
    histories = {"s1": [5, 17, 42], "s2": list(range(30, 55)), "s3": [8, 9]}

    def step(names):
        got = expert.step([StepRequest(s, histories[s]) for s in names])
        torch.testing.assert_close(got, _plain_last_logits(expert.model, [histories[s] for s in names]),
                                   rtol=1e-4, atol=1e-4)
        for s, row in zip(names, got):
            histories[s] = histories[s] + [int(row[:250].argmax())]

    for _ in range(8):
        step(["s1", "s2", "s3"])
    for _ in range(3):
        step(["s2"])  # alone: the single-session fast path over its own (copied-out) cache
    histories["s1"] = histories["s1"][:-2] + [11, 12, 13]  # diverges: crop + a 3-id chunk (transformers)
    for _ in range(4):
        step(["s1", "s2", "s3"])
    assert expert.fast_decode_steps >= 13


def test_fast_decoder_shares_the_models_weights(tiny_dir):
    """The fused projections are the model's own storage: the model's forward still works, unchanged."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "b", dtype=torch.float32).eval()
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        before = model(ids).logits
        decoder = FastDecoder(model)
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.untyped_storage().data_ptr() == decoder.qkv[0].untyped_storage().data_ptr()


def _greedy_tokens(tiny_dir, decode: str, prompts: list[list[int]], max_tokens: int = 10) -> list[list[int]]:
    from fusion.frontdoor.service import FusionService

    data = tiny_config_dict(tiny_dir)
    for expert in data["experts"]:
        expert["decode"] = decode
    service = FusionService.from_config(parse_config(data))
    try:
        engine = service.engine
        rule = make_rule("weighted_logits", {}, engine.names)
        requests = [GenerationRequest([p] * 3, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                              ignore_eos=True), rule, [0.5, 0.3, 0.2])
                    for p in prompts]
        events = engine.generate_many(requests)
        assert all(e.fast_decode_steps > 0 for e in engine.experts) == (decode != "transformers")
        return [[ev.token_id for ev in events[r.request_id]] for r in requests]
    finally:
        service.close()


def test_fast_decode_generates_the_tokens_of_transformers_decode(tiny_dir):
    prompts = [[5, 17, 42, 7], list(range(40, 70)), [9]]
    assert _greedy_tokens(tiny_dir, "fast", prompts) == _greedy_tokens(tiny_dir, "transformers", prompts)


def test_compiled_decode_step_equals_the_eager_one(tiny_dir):
    """The compiled step (`cudagraphs`: on a CPU, inductor compiles its graphs without recording any)
    gives the eager step's logits and keys/values, across batch sizes and buffer capacities
    (dynamic-shape compilations)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "b", dtype=torch.float32).eval()
    eager, compiled = DecodeStep(model, "off"), DecodeStep(model, "cudagraphs")
    generator = torch.Generator().manual_seed(0)
    config = model.config
    kv_heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    with torch.no_grad():
        for batch, capacity in ((1, 9), (3, 14), (2, 30)):
            keys = [torch.randn(batch, kv_heads, capacity, dim, generator=generator) for _ in range(2)]
            values = [torch.randn(batch, kv_heads, capacity, dim, generator=generator) for _ in range(2)]
            ids = torch.randint(0, config.vocab_size, (batch,), generator=generator)
            positions = torch.randint(1, capacity, (batch,), generator=generator)
            columns = torch.arange(capacity)
            mask = (columns[None] < positions[:, None]).view(batch, 1, 1, capacity)
            expected = eager(ids, positions, keys, values, mask)
            got = compiled(ids, positions, keys, values, mask)
            for g, e in zip(got, expected):
                torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
        # One cached row read by three rows (a lookahead after one history): the rows of a batch holding
        # a copy of it each, eagerly and compiled.
        keys = [torch.randn(1, kv_heads, 12, dim, generator=generator) for _ in range(2)]
        values = [torch.randn(1, kv_heads, 12, dim, generator=generator) for _ in range(2)]
        ids = torch.randint(0, config.vocab_size, (3,), generator=generator)
        positions, mask = torch.full((3,), 8), (torch.arange(12) < 8).view(1, 1, 1, 12)
        copied = [[t.expand(3, -1, -1, -1).contiguous() for t in ts] for ts in (keys, values)]
        expected = eager(ids, positions, *copied, mask.expand(3, -1, -1, -1))
        for step in (eager, compiled):
            for g, e in zip(step(ids, positions, keys, values, mask), expected):
                torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
    assert compiled.first_call_s is not None


def test_cuda_graph_steps_compile_their_own_graphs_and_run_each_on_one_thread_of_its_own(tiny_dir):
    """`cudagraphs` steps (here on the CPU, where inductor compiles them without graphs) of two models of
    one shape: each compiles a graph of its own (dynamo would share one, and with it the CUDA graphs bound
    to one thread's tree manager) and runs it on its own thread whichever threads call, with the eager
    step's results."""
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    models = [AutoModelForCausalLM.from_pretrained(tiny_dir / name, dtype=torch.float32).eval() for name in "ab"]
    assert models[0].config.to_dict() | {"_name_or_path": ""} == models[1].config.to_dict() | {"_name_or_path": ""}
    eager = [DecodeStep(model, "off") for model in models]
    compiled = [DecodeStep(model, "cudagraphs") for model in models]
    ran_on: list[list[int]] = [[], []]
    for step, threads in zip(compiled, ran_on):
        forward = step._run

        def recording(*inputs, forward=forward, threads=threads):
            threads.append(threading.get_ident())
            return forward(*inputs)

        step._run = recording
    generator = torch.Generator().manual_seed(0)
    config = models[0].config
    kv_heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    batch, capacity = 2, 9
    keys = [torch.randn(batch, kv_heads, capacity, dim, generator=generator) for _ in range(2)]
    values = [torch.randn(batch, kv_heads, capacity, dim, generator=generator) for _ in range(2)]
    ids = torch.randint(0, config.vocab_size, (batch,), generator=generator)
    positions = torch.tensor([3, 7])
    mask = (torch.arange(capacity)[None] < positions[:, None]).view(batch, 1, 1, capacity)
    inputs = (ids, positions, keys, values, mask)
    graphs_before = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        expected = [step(*inputs) for step in eager]
        results = [(k, compiled[k](*inputs)) for k in (0, 1)]
        with ThreadPoolExecutor(max_workers=2) as callers:  # two other callers, at once
            results += list(callers.map(lambda k: (k, compiled[k](*inputs)), [0, 1, 0, 1, 1, 0]))
    assert counters["stats"]["unique_graphs"] - graphs_before == 2
    for k, got in results:
        for g, e in zip(got, expected[k]):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
    assert [len(threads) for threads in ran_on] == [4, 4]
    assert all(len(set(threads)) == 1 for threads in ran_on) and set(ran_on[0]) != set(ran_on[1])
    assert threading.get_ident() not in ran_on[0] + ran_on[1]


def test_cuda_graph_steps_take_turns_only_where_torch_does_not_serialise_recordings(monkeypatch):
    from torch._inductor import cudagraph_trees

    from fusion.forward import graph_thread
    assert isinstance(graph_thread.turns(), contextlib.nullcontext)  # torch 2.13: its own graph_capture_lock
    monkeypatch.delattr(cudagraph_trees, "graph_capture_lock")
    assert graph_thread.turns() is graph_thread._TAKE_TURNS


@pytest.mark.parametrize("torch_initialises", [True, False], ids=["with torch's initializer", "written out"])
def test_a_new_thread_gets_the_cuda_graph_trees_state_older_torch_asserted_on(monkeypatch, torch_initialises):
    """`prepare_graph_trees` gives a fresh thread the per-thread state that torch before 2.13 looked up
    with a bare assert (its `get_obj`, written out below), its own, not the importing thread's: through
    torch's `_initialize_tls` where it has one, else written out as torch writes it."""
    from torch._inductor import cudagraph_trees

    if not torch_initialises:
        monkeypatch.delattr(cudagraph_trees, "_initialize_tls")

    from fusion.forward.graph_thread import TREE_STATE, prepare_graph_trees

    def older_get_obj(local, name):  # torch 2.11's cudagraph_trees.get_obj
        if hasattr(local, name):
            return getattr(local, name)
        assert torch._C._is_key_in_tls(name)
        return torch._C._get_obj_in_tls(name)

    mine = {name: cudagraph_trees.get_obj(cudagraph_trees.local, name) for name in TREE_STATE}

    def in_a_new_thread(prepare: bool):
        if prepare:
            prepare_graph_trees()
        return {name: older_get_obj(cudagraph_trees.local, name) for name in TREE_STATE}

    with ThreadPoolExecutor(max_workers=1) as fresh, pytest.raises(AssertionError):
        fresh.submit(in_a_new_thread, False).result()
    with ThreadPoolExecutor(max_workers=1) as fresh:
        theirs = fresh.submit(in_a_new_thread, True).result()
    assert all(theirs[name] is not mine[name] for name in TREE_STATE)
    assert theirs["tree_manager_containers"] == {}
    prepare_graph_trees()  # where the state exists already, nothing changes
    assert all(cudagraph_trees.get_obj(cudagraph_trees.local, name) is mine[name] for name in TREE_STATE)


def test_compiled_decode_on_a_cpu_is_refused_naming_the_fast_step(tiny_dir):
    """`decode: compiled` captures CUDA graphs; on a CPU the C step (`decode: fast`) is the fast path. The
    config says so when it is read; an expert whose device resolves to a CPU at load says it too."""
    with pytest.raises(ConfigError, match="decode: compiled runs on CUDA .* on cpu use decode: fast"):
        _expert(tiny_dir / "b", "compiled")
    config = parse_config({"experts": [{"name": "x", "model": str(tiny_dir / "b"), "dtype": "float32"}]})
    expert = config.experts[0].model_copy(update={"decode": "compiled"})  # as a device resolved to a CPU
    with pytest.raises(ValueError, match="decode: compiled runs on CUDA .* on cpu use decode: fast"):
        LocalExpert.load(expert)


@pytest.mark.cuda
def test_compiled_experts_of_three_shapes_each_get_their_graphs(tiny_dir, tmp_path):
    """Every compiled step enters dynamo through the same frame; three experts of different widths bring
    three graphs each, past dynamo's default cap of 8 graphs a frame, and none is left eager (on a GPU:
    `decode: compiled` runs on CUDA only)."""
    from torch._dynamo.utils import counters
    from transformers import AutoTokenizer

    from tests.tiny_models import make_model

    torch._dynamo.reset()
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "tok")
    graphs = counters["stats"]["unique_graphs"]
    for hidden in (32, 48, 64):
        make_model(tmp_path / f"h{hidden}", tokenizer, seed=hidden, hidden=hidden)
        _cuda_expert(tmp_path / f"h{hidden}", "compiled")
    assert counters["stats"]["unique_graphs"] - graphs == 3 * 3


def test_unsupported_models_fall_back_or_refuse(tiny_dir, tmp_path):
    """A model the fast step cannot run decodes through transformers under `fast`; `compiled` refuses it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "a", dtype=torch.float32)
    model.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    assert "rope type 'dynamic'" in unsupported_reason(model)  # its frequencies change with the length
    path = tmp_path / "dynamic-rope"
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_dir / "tok").save_pretrained(path)
    assert _expert(path, "fast")._fast_step is None
    assert unsupported_reason(model, compiled=True) is not None  # (decode: compiled, CUDA only, refuses it)
    from transformers import LlamaConfig, LlamaForCausalLM

    biased = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, attention_bias=True))
    assert "output projection" in unsupported_reason(biased)
    with pytest.raises(ConfigError, match="decode"):
        parse_config({"experts": [{"name": "x", "model": "m", "decode": "jit"}]})


# -- on a CUDA device (benchmarks/gpu_check.sh; deselected elsewhere, the CPU tests above cover the same paths)
def _cuda_expert(path, decode: str) -> LocalExpert:
    config = parse_config({"experts": [{"name": "x", "model": str(path), "dtype": "float32", "device": "cuda",
                                        "decode": decode}]})
    return LocalExpert.load(config.experts[0])


@pytest.mark.cuda
@pytest.mark.parametrize("decode", ["fast", "compiled"])
def test_cuda_decode_equals_plain_forwards(tiny_dir, monkeypatch, decode):
    """Fast and CUDA-graph-compiled decode steps on a GPU, batched and alone, through buffer growths,
    give the logits of an uncached forward."""
    monkeypatch.setattr(kv_cache, "DEFAULT_SPARE", 2)
    expert = _cuda_expert(tiny_dir / "a", decode)
    assert expert._fast_step.mode == ("off" if decode == "fast" else "cudagraphs")
    histories = {"s1": [5, 17, 42], "s2": list(range(30, 55)), "s3": [8, 9]}
    for names in [["s1", "s2", "s3"]] * 6 + [["s2"]] * 3 + [["s1", "s3"]] * 3:
        got = expert.step([StepRequest(s, histories[s]) for s in names])
        torch.testing.assert_close(got, _plain_last_logits(expert.model, [histories[s] for s in names]).to(got.device),
                                   rtol=1e-3, atol=1e-3)
        for s, row in zip(names, got):
            histories[s] = histories[s] + [int(row[:250].argmax())]
    assert expert.fast_decode_steps >= 10


@pytest.mark.cuda
@pytest.mark.parametrize("decode", ["fast", "compiled"])
def test_cuda_trio_overlapped_on_streams_equals_the_cpu_trio(tiny_dir, decode):
    """Three experts on one GPU (a CUDA stream and a pool thread each, overlapped; compiled: each step's
    CUDA graphs recorded and replayed on its own thread, on the caller's stream) fuse to the CPU trio's
    logits."""
    from fusion.frontdoor.service import FusionService

    fused = {}
    for device in ("cpu", "cuda"):
        data = tiny_config_dict(tiny_dir)
        for expert in data["experts"]:
            expert["device"] = device
            expert["decode"] = decode if device == "cuda" else "transformers"
        service = FusionService.from_config(parse_config(data))
        try:
            engine = service.engine
            rule = make_rule("weighted_logits", {}, engine.names)
            batch = engine.new_batch()
            for prompt in ([5, 17, 42, 7], list(range(40, 70))):
                batch.add(engine.admit(GenerationRequest([prompt] * 3, SamplingParams(max_tokens=8, temperature=0.0),
                                                         rule, [0.5, 0.3, 0.2])))
            steps = []
            for _ in range(6):
                step = batch.fused_logits()
                steps.append(step.fused.cpu())
                batch.emit_tokens(step)
            fused[device] = torch.stack(steps)
            if device == "cuda":
                assert all(s is not None for s in engine._streams)
        finally:
            service.close()
    torch.testing.assert_close(fused["cuda"], fused["cpu"], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_is_attention_written_out(dtype):
    """The decode steps' attention over masked cached columns and the row's own new column, eagerly and
    compiled, against softmax(q·k / sqrt(D)) · v in float64 with each kv head repeated for its group
    (within the dtype's rounding)."""
    generator = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, width = 6, 2, 8, 11
    step = attend
    compiled = torch.compile(step, dynamic=True)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for rows in (1, 2):
        q, k, v = (torch.randn(rows, h, dim, generator=generator).to(dtype) for h in (heads, kv_heads, kv_heads))
        keys, values = (torch.randn(rows, kv_heads, width, dim, generator=generator).to(dtype) for _ in range(2))
        filled = torch.tensor([7, 4][:rows])
        mask = (torch.arange(width)[None] < filled[:, None]).view(rows, 1, 1, width)
        expected = []
        for row in range(rows):
            n = int(filled[row])
            all_keys = torch.cat((keys[row, :, :n], k[row, :, None]), dim=1).double()  # (H_kv, n + 1, D)
            all_values = torch.cat((values[row, :, :n], v[row, :, None]), dim=1).double()
            all_keys, all_values = (t.repeat_interleave(heads // kv_heads, dim=0) for t in (all_keys, all_values))
            scores = (q[row].double()[:, None, :] * all_keys).sum(-1) * dim ** -0.5  # (H, n + 1)
            expected.append((scores.softmax(-1)[:, :, None] * all_values).sum(1).reshape(heads * dim))
        expected = torch.stack(expected)  # (rows, H·D)
        for got in (step(q, k, v, keys, values, dim ** -0.5, mask), compiled(q, k, v, keys, values, dim ** -0.5, mask)):
            assert got.shape == (rows, heads * dim) and got.dtype == dtype
            torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)


def test_eager_cpu_attention_of_bf16_rounds_once():
    """An eager step on a CPU runs attention's products in float32 (`attention_dtype`: bf16 batched products
    of these shapes measured several times slower): bf16 queries, keys and values give the float64 result
    of those same values rounded once to bf16, where bf16 products would round the scores and the
    probabilities too."""
    generator = torch.Generator().manual_seed(6)
    heads, kv_heads, dim, width, rows = 6, 2, 64, 300, 3
    q, k, v = (torch.randn(rows, h, dim, generator=generator).bfloat16() for h in (heads, kv_heads, kv_heads))
    keys, values = (torch.randn(rows, kv_heads, width, dim, generator=generator).bfloat16() for _ in range(2))
    all_keys = torch.cat((keys, k[:, :, None]), dim=2).double().repeat_interleave(heads // kv_heads, dim=1)
    all_values = torch.cat((values, v[:, :, None]), dim=2).double().repeat_interleave(heads // kv_heads, dim=1)
    scores = (q.double()[:, :, None, :] * all_keys).sum(-1) * dim ** -0.5  # (rows, H, width + 1)
    expected = (scores.softmax(-1)[..., None] * all_values).sum(2).reshape(rows, heads * dim)
    got = attend(q, k, v, keys, values, dim ** -0.5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), expected, rtol=2 ** -8, atol=2e-4)
