"""One OpenMP team per process (fusion.compute): experts load and step on the compute thread, and their
work called from any other thread (a fingerprint, a rule's router) runs on that thread alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import torch

import fusion.experts.expert as expert_module
from fusion.compute import on_compute_thread, run_on_compute_thread
from fusion.config import parse_config
from fusion.experts.expert import LocalExpert
from fusion.fuse.router import expert_fingerprint
from tests.conftest import tiny_config_dict


def test_experts_load_on_the_compute_thread_and_fingerprint_on_one_thread(tiny_dir, monkeypatch):
    seen = {}
    load = expert_module.load_model_and_tokenizer

    def recording_load(*args, **kwargs):
        seen["load"] = on_compute_thread()
        return load(*args, **kwargs)

    monkeypatch.setattr(expert_module, "load_model_and_tokenizer", recording_load)
    expert = LocalExpert.load(parse_config(tiny_config_dict(tiny_dir)).experts[0])
    score = expert.score

    def recording_score(*args, **kwargs):
        seen["fingerprint threads"] = torch.get_num_threads()
        return score(*args, **kwargs)

    monkeypatch.setattr(expert, "score", recording_score)
    mine = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        expert_fingerprint(expert)  # called here, off the compute thread: on this thread alone
    finally:
        torch.set_num_threads(mine)
    assert seen == {"load": True, "fingerprint threads": 1}


def test_expert_work_off_the_compute_thread_runs_on_one_thread(tiny_dir):
    """The forward sees one thread when called from this thread and the compute thread's team on it;
    the caller's own setting is restored."""
    expert = LocalExpert.load(parse_config(tiny_config_dict(tiny_dir)).experts[0])
    threads_in_forward = []
    expert.model.register_forward_pre_hook(lambda *_: threads_in_forward.append(torch.get_num_threads()))
    compute_threads = run_on_compute_thread(torch.get_num_threads)
    run_on_compute_thread(torch.set_num_threads, 2)
    mine = torch.get_num_threads()
    try:
        expert.score("here", [5, 17, 42, 7], 2)
        run_on_compute_thread(expert.score, "there", [5, 17, 42, 7], 2)
    finally:
        run_on_compute_thread(torch.set_num_threads, compute_threads)
    assert threads_in_forward == [1, 2]
    assert torch.get_num_threads() == mine


def test_a_service_leaves_the_main_thread_without_an_openmp_team(smollm2_dir, tmp_path):
    """A real SmolLM2 service, loaded, fingerprinted, admitting (a bias row), generating and scoring, all
    driven from the main thread: the main thread's first parallel region afterwards starts a new OpenMP worker, so it had no
    team (a second team would slow every forward of the compute thread's: see fusion.compute)."""
    script = textwrap.dedent(f"""
        import json, os, torch
        from fusion.config import parse_config
        from fusion.fuse.router import expert_fingerprint
        from fusion.frontdoor.service import FusionService

        def threads():
            return len(os.listdir("/proc/self/task"))

        config = parse_config({{"experts": [{{"name": "smol", "model": {str(smollm2_dir)!r}}}],
                               "fusion": {{"rule": "single", "params": {{"expert": "smol"}}}}}})
        service = FusionService.from_config(config)
        expert_fingerprint(service.experts[0])
        text = service.complete("What is 2 + 2?", {{"max_tokens": 4}}).text
        service.complete("Hi", {{"max_tokens": 2, "logit_bias": {{"42": 1.0}}}})  # a (V,) bias row at admission
        service.score("The capital of France is", " Paris.")
        before = threads()
        torch.ones(1 << 24).sum()  # the main thread's first parallel region
        print(json.dumps({{"new_threads": threads() - before, "text": text}}))
        service.close()
    """)
    env = dict(os.environ, OMP_NUM_THREADS="2")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["text"]
    assert report["new_threads"] == 1  # its team's one worker, started only now
