"""Logit fusion: several causal LMs decode one sequence; their next-token logits are merged per step.

The runtime's layers, each importing only those above it in this list:
  config, errors, models, compute, own_thread
                          what a deployment asks for, its errors, the model cache, the compute threads
  forward/                one model's decode step per device, its weights, caches and C kernels
  experts/                an expert: a model, its sessions, adapters over a shared base
  fuse/                   the merge: rules, the learned router, the sampler, grammars
  crosstok/               experts of different tokenizers, fused over text
  engine/                 batching, scheduling, fair share, admission
  frontdoor/              FusionService: every caller's one door
Servers (services/: gRPC, HTTP), Ray Serve (deploy/) and the tools (fusion.tools: CLI, eval, bench,
training) sit above; the runtime never imports them.
"""

__version__ = "0.1.0"
