"""Train a router on logged expert outputs (the experts are frozen and never touched).

For each training text the experts' teacher-forced logits are computed once through the engine
(so local and remote experts both work), then the router takes a few optimiser steps on them:

    loss = CE(fused distribution, reference next token)      the fused distribution under `tau`, if set
         + route_weight · CE(route logits, best expert)   only where the experts' top-1 choices differ

         + comp_l2 · Σ_v complementary logit² (mean over positions) keeps the complementary logit small off-domain

"Best expert" is the one giving the reference token the highest probability, as FusionRoute does.
A training sample is a text, either plain (on its own after the BOS or eos, as `fusion eval` scores text) or
the answer to a chat prompt formatted by each expert's own template (as `fusion generate` runs).
The default mix draws from each domain's training split; evaluation texts are held out.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from fusion.compute import run_on_compute_thread
from fusion.models import ROUTERS_DIR, experts_key
from fusion.frontdoor.service import FusionService
from fusion.fuse.router import FamiliarityGate, Router, RouterShape, expert_fingerprint, save_router
from fusion.fuse.rules import check_tau, confidence_weights, teacher_forced_context
from fusion.frontdoor.text import TextSample
from fusion.tools.progress import progress_line
from fusion.tools.training.borrowed import BorrowedEmbedding

logger = logging.getLogger(__name__)


LR_SCHEDULES = ("constant", "cosine")
DEFAULT_ROUTE_WEIGHT = 0.5  # the route loss's weight beside the fused cross-entropy


@dataclass
class RouterTrainSettings:
    minutes: float = 5.0
    max_texts: int | None = None
    steps_per_text: int = 2
    lr: float = 3e-3
    # "cosine": the rate falls from `lr` to `lr * min_lr_ratio` over the run's budget (texts or minutes, whichever
    # ends it first), so that the router ends where many texts agree rather than where the last few pulled it
    # (one text a step: at a constant rate, routers drawn with different seeds differed by points of accuracy).
    lr_schedule: str = "constant"
    min_lr_ratio: float = 0.05
    route_weight: float = DEFAULT_ROUTE_WEIGHT
    comp_l2: float = 1e-3
    comp_rank: int = 16  # the complementary head's rank (RouterShape.comp_rank; 0: one hidden → vocab layer)
    seq_tokens: int = 192
    seed: int = 0
    # Read the context through the first in-process expert's input embeddings (frozen, projected to the
    # router's width) instead of learning a table: tokens the router never saw in training then land
    # near the ones it did, so unseen wording of a familiar task is routed like the familiar one.
    borrow_embeddings: bool = True
    gate_texts: int = 48  # texts whose router inputs fit the FamiliarityGate (half fit, half set its limit)
    generalist: int = 0  # the expert the gate pulls unfamiliar steps towards (the config's first)
    # The route rule's confidence scaling (`tau`) the loss reads the mixture under, recorded in the checkpoint
    # and applied by a route rule serving it unless a request's params say otherwise. Trained under it, the
    # router learns to hold the scaling back where its own weights already fit (the text it was trained on),
    # while the scaling still moves steps it cannot place (an arithmetic question in unseen words, where the
    # arithmetic expert is sure and the others are not). None: trained and served without it.
    tau: float | None = None

    def __post_init__(self) -> None:
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule (--lr-schedule) must be one of {list(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        if self.tau is not None:
            try:
                self.tau = check_tau("route", self.tau)
            except ValueError:
                raise ValueError(f"tau (--tau) must be a finite number > 0, got {self.tau!r}") from None
        if not (math.isfinite(self.route_weight) and self.route_weight >= 0):
            raise ValueError(f"route_weight (--route-weight) must be a finite number >= 0, got {self.route_weight!r}")


@dataclass
class RouterTrainResult:
    path: Path
    texts: int
    steps: int
    first_loss: float
    last_loss: float
    seconds: float


def borrowed_table(engine, vocab_size: int) -> torch.Tensor | None:
    """The first in-process expert's input embeddings [vocab_size, H] (float32), or None (remote experts,
    or a table narrower than the fused vocabulary)."""
    for expert in engine.experts:
        model = getattr(expert, "model", None)
        if model is None or not hasattr(model, "get_input_embeddings"):
            continue
        table = model.get_input_embeddings().weight.detach()
        if table.shape[0] >= vocab_size:
            logger.info("router: reading context through %s's input embeddings", expert.info.name)
            return table[:vocab_size].float()
    return None


def run_progress(settings: RouterTrainSettings, elapsed_s: float, texts_done: int) -> float:
    """How far the run is through its budget: its minutes or its texts, whichever is further along."""
    done = elapsed_s / (settings.minutes * 60)
    return max(done, texts_done / settings.max_texts) if settings.max_texts else done


def lr_factor(settings: RouterTrainSettings, elapsed_s: float, texts_done: int) -> float:
    """The learning rate's share of `settings.lr` at this point of the run: 1 throughout for "constant";
    for "cosine", from 1 down to `min_lr_ratio` as the run's budget (its texts or its minutes, whichever is
    further along) is spent."""
    if settings.lr_schedule == "constant":
        return 1.0
    done = min(1.0, run_progress(settings, elapsed_s, texts_done))
    return settings.min_lr_ratio + (1 - settings.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * done))


def router_loss(router: Router, logits: torch.Tensor, context: torch.Tensor, targets: torch.Tensor,
                route_weight: float, comp_l2: float = 0.0, tau: float | None = None) -> torch.Tensor:
    """logits (E, n, V) of the frozen experts, context (n, K) recent ids, targets (n,) → scalar loss; with
    `tau`, the mixture's weights scaled by each expert's confidence as the route rule serves them."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)  # (E, n, V)
    inputs = router.inputs(log_probs, context)  # (n, F): the logit features first, each expert's entropy leading
    route_logits, weights, comp = router.head(inputs)
    if tau is not None:  # as `Router._fuse_from` does at serving time
        weights = confidence_weights(weights, inputs[:, :weights.shape[0]].T, tau)  # (E, n)
    fused = torch.logsumexp(torch.log(weights)[..., None] + log_probs, dim=0)  # (n, V)
    if comp is not None:
        fused = fused + comp
    loss = torch.nn.functional.cross_entropy(fused, targets)
    if comp is not None and comp_l2 > 0:  # an L2 penalty per position, summed over the vocabulary
        loss = loss + comp_l2 * comp.pow(2).sum(-1).mean()
    top1 = log_probs.argmax(-1)  # (E, n)
    disagree = (top1 != top1[:1]).any(0)  # (n,)
    if route_weight > 0 and bool(disagree.any()):
        best = log_probs.gather(-1, targets[None, :, None].expand(log_probs.shape[0], -1, 1))[..., 0].argmax(0)
        loss = loss + route_weight * torch.nn.functional.cross_entropy(route_logits[disagree], best[disagree])
    return loss


# Requests whose chat answers are prose or code, so that the router learns a chat turn is not by itself
# a sign of arithmetic.
_PROSE_REQUESTS = ("Tell me about {}.", "Explain {} in Python.", "Write a short paragraph about {}.",
                   "What should I know about {}?", "Describe {}, please.", "How does {} work?")
_CODE_REQUESTS = ("Show me some Python code from the {} module.", "Write Python code like {}.py.",
                  "Give me an example of Python source, e.g. from {}.")
# Arithmetic questions in words training's phrasings never use. The router reads the question's words through
# its context windows; trained on training's phrasings alone, it sent questions in unseen wordings ("7 weeks
# of 27 per week") to another expert at the answer's first tokens, where the arithmetic expert restates the
# problem ("7*27:") and the others copy the question's words, and the answer never recovered. A sentence of
# unrelated prose beside the question, or random words in place of the operation's, teaches it that the
# words around and between the numbers do not decide who answers.
FRAMED_ARITHMETIC_SHARE = 0.3  # a prose sentence before or after the question
UNFAMILIAR_OPERATION_SHARE = 0.3  # two numbers joined by random prose words, in a training frame
FUNCTION_CHAT_SHARE = 0.05  # of all texts; a tenth cost arithmetic accuracy on every wording


def prose_sentences(texts: Sequence[str]) -> list[str]:
    """The sentences of `texts` of 4 to 30 words, with no digits (they would blur the question's numbers)
    and none of the grammar notation or code the pydoc topics carry."""
    sentences = []
    for text in texts:
        for sentence in re.split(r"(?<=[.!?])\s+", " ".join(text.split())):
            words = sentence.split()
            if 4 <= len(words) <= 30 and sentence[0].isupper() and re.fullmatch(r"[A-Za-z ,;:'\"()-]+[.!?]", sentence):
                sentences.append(sentence)
    return sentences


def framed_question(question: str, sentences: Sequence[str], rng: random.Random) -> str:
    """`question` with a random sentence before or after it."""
    sentence = rng.choice(sentences)
    return f"{sentence} {question}" if rng.random() < 0.5 else f"{question} {sentence}"


def held_out_words() -> set[str]:
    """Every word of every held-out phrasing (templates, styles, word problems): random operation words
    never compose a held-out wording."""
    from fusion.tools.training.arithmetic import PHRASINGS, WORD_PHRASINGS

    texts = [t for split, (templates, styles) in PHRASINGS.items() if split != "train"
             for t in [*styles, *(t for ts in templates.values() for t in ts)]]
    texts += [t for split, problems in WORD_PHRASINGS.items() if split != "train" for ts in problems.values() for t in ts]
    return {w.lower() for t in texts for w in re.findall(r"[A-Za-z]+", t)}


def unfamiliar_question(a: int, b: int, words: Sequence[str], rng: random.Random) -> str:
    """`a` and `b` joined by one to three of `words` in place of an operation, in a training frame."""
    from fusion.tools.training.arithmetic import EXTRA_FRAMES, FRAMES

    joined = " ".join(rng.choice(words) for _ in range(rng.randint(1, 3)))
    return rng.choice(FRAMES + EXTRA_FRAMES).replace("{e}", f"{a} {joined} {b}")


def default_training_samples(seed: int) -> Iterator[TextSample]:
    """An endless shuffled mix of the training splits: arithmetic questions answered in chat turns (some beside
    a sentence of prose, some with random words for the operation); Python source and English prose (the
    standard library's pydoc topics), each both as plain text and as the answer to a chat request; and
    documented functions' bodies asked as HumanEval asks."""
    import pydoc_data.topics as topics

    from fusion.tools.executed_code import humaneval_messages
    from fusion.tools.training.long_arithmetic import answer_text, question_text, training_expr
    from fusion.tools.training.python_code import stdlib_files
    from fusion.tools.training.python_functions import training_functions

    rng = random.Random(f"router:{seed}")
    code_files = stdlib_files(held_out=False)
    functions = training_functions()
    prose = [(name, text) for name, text in topics.topics.items() if len(text) > 400]
    sentences = prose_sentences([text for _, text in prose])
    words = sorted({w for s in sentences for w in re.findall(r"\b[a-z]{3,}\b", s)} - held_out_words())

    def arithmetic() -> TextSample:
        problem = training_expr(rng)  # training's problems of every size, worked as the specialist works them
        draw = rng.random()
        if len(problem.ops) == 1 and draw < UNFAMILIAR_OPERATION_SHARE:
            question = unfamiliar_question(*problem.terms, words, rng)
        else:
            question = question_text(problem, rng, "train")
            if draw > 1 - FRAMED_ARITHMETIC_SHARE:
                question = framed_question(question, sentences, rng)
        return TextSample(answer_text(problem), prompt=question, end_turn=True)

    def window(text: str) -> str:
        start = rng.randrange(max(1, len(text) - 1500))
        return text[start:start + 1500]

    def code() -> TextSample:
        return TextSample(window(rng.choice(code_files).read_text(encoding="utf-8", errors="replace")))

    def general() -> TextSample:
        return TextSample(window(rng.choice(prose)[1]))

    def prose_chat() -> TextSample:
        name, text = rng.choice(prose)
        subject = name.replace("-", " ")
        return TextSample(text.strip()[:700], prompt=rng.choice(_PROSE_REQUESTS).format(subject))

    def code_chat() -> TextSample:
        path = rng.choice(code_files)
        text = path.read_text(encoding="utf-8", errors="replace")
        return TextSample(window(text)[:700], prompt=rng.choice(_CODE_REQUESTS).format(path.stem))

    def function_chat() -> TextSample:
        # a documented function's body, asked as `fusion eval --humaneval` asks (the answer opened with the
        # signature and docstring, healed): the docstring before the body reads as prose, a context the
        # rest of the mix only ever follows with prose
        function = rng.choice(functions)
        return TextSample(function.body + "```", prompt=humaneval_messages(function.prompt), end_turn=True,
                          continued=True)

    sources = [arithmetic, code, general, prose_chat, code_chat, function_chat]
    shares = [0.3, 0.175 - FUNCTION_CHAT_SHARE / 2, 0.175, 0.2, 0.15 - FUNCTION_CHAT_SHARE / 2, FUNCTION_CHAT_SHARE]
    while True:
        yield rng.choices(sources, shares)[0]()


def file_samples(paths: Sequence[Path], seed: int, window_chars: int = 1500) -> Iterator[TextSample]:
    """An endless shuffled stream from user data: `.jsonl` lines {"prompt": ..., "text": ...} (prompt
    optional, and a prompted text ends the chat turn; "completion" is accepted for "text"), any other
    file read as plain text in windows."""
    import json

    samples: list[TextSample] = []
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"--data: no such file: {path}")
        if path.suffix == ".jsonl":
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    text = record.get("text", record.get("completion"))
                    prompt = record.get("prompt")
                except (json.JSONDecodeError, AttributeError):
                    raise ValueError(f"--data: {path}:{number} is not a JSON object") from None
                if not isinstance(text, str) or not text or not (prompt is None or isinstance(prompt, str)):
                    raise ValueError(f"--data: {path}:{number} needs a non-empty string \"text\" "
                                     "(and an optional string \"prompt\")")
                samples.append(TextSample(text, prompt, end_turn=prompt is not None))
        else:
            text = path.read_text(encoding="utf-8", errors="replace")
            samples += [TextSample(text[i:i + window_chars]) for i in range(0, len(text), window_chars)
                        if text[i:i + window_chars].strip()]
    if not samples:
        raise ValueError(f"--data: no samples in {[str(p) for p in paths]}")
    rng = random.Random(f"router-data:{seed}")
    while True:
        yield samples[rng.randrange(len(samples))]


class hashed_samples:
    """The training texts, hashed as they are drawn: the data hash of a router's manifest."""

    def __init__(self, texts: Iterator[TextSample | str]) -> None:
        self.texts = texts
        self.sha = hashlib.sha256()

    def __iter__(self):
        return self

    def __next__(self) -> TextSample | str:
        sample = next(self.texts)
        parts = [sample] if isinstance(sample, str) else [sample.prompt or "", sample.text]
        self.sha.update(json.dumps(parts).encode())
        return sample

    def hexdigest(self) -> str:
        return self.sha.hexdigest()


def ship_router(trained: Path, service: FusionService, figures: dict | None = None) -> Path:
    """Copy a router trained for the service's config experts into the project (`fusion.models.ROUTERS_DIR`)
    as the one `router: auto` finds for exactly those config experts: its matrices in bf16 (half the
    bytes), checked by names and tokenizers (`fusion.fuse.router.check_experts`), with a manifest beside it."""
    payload = torch.load(trained, map_location="cpu", weights_only=True)
    payload["state_dict"] = {k: v.to(torch.bfloat16) if v.is_floating_point() and v.dim() >= 2 else v
                             for k, v in payload["state_dict"].items()}
    payload["identity"] = "config"
    payload["tokenizers"] = [e.info.tokenizer_fingerprint for e in service.engine.experts]
    config_experts = service.config.experts
    dest = ROUTERS_DIR / f"router-{experts_key(config_experts)}.pt"
    dest.parent.mkdir(parents=True, exist_ok=True)
    torch.save(payload, dest)
    metadata = json.loads(payload["metadata"])
    settings = metadata.get("settings") or {}
    manifest = {
        "experts": [[e.name, e.model, e.adapter] for e in config_experts],
        "recipe": metadata.get("settings"),
        "command": (f"fusion train-router --ship --max-texts {metadata.get('texts')} --seed {metadata.get('seed')} "
                    f"--minutes {settings.get('minutes')} --comp-l2 {settings.get('comp_l2')} "
                    f"--lr-schedule {settings.get('lr_schedule', 'constant')}"
                    + (f" --tau {settings['tau']:g}" if settings.get("tau") is not None else "")
                    + (f" --route-weight {settings['route_weight']:g}"
                       if settings.get("route_weight", DEFAULT_ROUTE_WEIGHT) != DEFAULT_ROUTE_WEIGHT else "")),
        "seed": metadata.get("seed"),
        "data_sha256": metadata.get("data_sha256"),
        "texts": metadata.get("texts"), "steps": metadata.get("steps"),
        "first_loss": metadata.get("first_loss"), "last_loss": metadata.get("last_loss"),
        "train_seconds": {"cpu" if not torch.cuda.is_available() else "gpu": round(metadata.get("seconds", 0), 1)},
        "sha256": hashlib.sha256(dest.read_bytes()).hexdigest(),
        "eval": figures or {},
    }
    dest.with_suffix(".json").write_text(json.dumps(manifest, indent=2) + "\n")
    logger.info("router shipped as %s", dest)
    return dest


def train_router(
    service: FusionService,
    out: Path,
    *,
    texts: Iterator[TextSample | str] | None = None,
    settings: RouterTrainSettings | None = None,
    shape: RouterShape | None = None,
    on_step: Callable[[int, float], None] | None = None,
) -> RouterTrainResult:
    """Train a router on the service's experts and save it to `out`. Runs on the compute thread,
    beside the experts' forwards (see fusion.compute)."""
    return run_on_compute_thread(_train_router, service, out, texts, settings, shape, on_step)


def _train_router(service, out, texts, settings, shape, on_step) -> RouterTrainResult:
    settings = settings or RouterTrainSettings()
    engine = service.engine
    torch.manual_seed(settings.seed)
    shape = shape or RouterShape(num_experts=len(engine.experts), vocab_size=engine.vocab_size,
                                 comp_rank=settings.comp_rank)
    router = Router(shape)
    table = borrowed_table(engine, shape.vocab_size) if settings.borrow_embeddings else None
    if table is not None:
        router.embed = BorrowedEmbedding(table, shape.embed_dim, std=1.0)  # nn.Embedding's scale
    optimiser = torch.optim.AdamW(router.parameters(), lr=settings.lr, weight_decay=0.0)
    texts = hashed_samples(texts or default_training_samples(settings.seed))
    start = time.perf_counter()
    deadline = start + settings.minutes * 60
    n_texts = steps = 0
    first_loss = last_loss = math.nan
    ema = None
    while time.perf_counter() < deadline and (settings.max_texts is None or n_texts < settings.max_texts):
        logits, context, targets = logged_text(service, texts, settings.seq_tokens)
        router.train()
        for group in optimiser.param_groups:
            group["lr"] = settings.lr * lr_factor(settings, time.perf_counter() - start, n_texts)
        for _ in range(settings.steps_per_text):
            loss = router_loss(router, logits, context, targets, settings.route_weight, settings.comp_l2,
                               settings.tau)
            optimiser.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(router.parameters(), 1.0)
            optimiser.step()
            steps += 1
            value = float(loss.detach())
            first_loss = value if math.isnan(first_loss) else first_loss
            last_loss = value
            ema = value if ema is None else 0.9 * ema + 0.1 * value
            if on_step:
                on_step(steps, value)
        n_texts += 1
        if n_texts % 10 == 0:
            elapsed = time.perf_counter() - start
            logger.info("router: %s  %d texts, %d steps, loss %.3f (ema %.3f)",
                        progress_line(run_progress(settings, elapsed, n_texts), elapsed),
                        n_texts, steps, last_loss, ema)
    router.eval()
    if table is not None:
        router.embed = router.embed.baked()
    if settings.gate_texts >= 2:
        router.gate = fit_gate(service, router, texts, settings)
    fingerprints = [expert_fingerprint(e) for e in engine.experts]
    seconds = time.perf_counter() - start
    save_router(router, out, engine.names, fingerprints, {
        "texts": n_texts, "steps": steps, "first_loss": first_loss, "last_loss": last_loss, "seconds": seconds,
        "seed": settings.seed, "borrowed_embeddings": table is not None, "data_sha256": texts.hexdigest(),
        "settings": asdict(settings),
    })
    logger.info("router saved to %s (%d texts, %d steps, loss %.3f → %.3f)", out, n_texts, steps, first_loss,
                last_loss)
    return RouterTrainResult(Path(out), n_texts, steps, first_loss, last_loss, seconds)


def logged_text(service: FusionService, texts: Iterator[TextSample | str], seq_tokens: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The next text of at least 4 tokens: the frozen experts' teacher-forced logits (E, n, V), each
    position's recent ids (n, K) and the reference tokens (n,)."""
    while True:
        prompts, continuation = service.sample_ids(next(texts), seq_tokens)
        if len(continuation) >= 4:
            break
    with torch.no_grad():
        logits = service.engine.continuation_logits(prompts, continuation)  # (E, n, V)
    context = teacher_forced_context(prompts[0], continuation, logits.device)  # (n, K)
    return logits, context, torch.tensor(continuation, device=logits.device)


def fit_gate(service: FusionService, router: Router, texts: Iterator[TextSample | str],
             settings: RouterTrainSettings) -> FamiliarityGate:
    """Fit the trained router's FamiliarityGate on the inputs it sees over `settings.gate_texts` more
    training texts: even texts fit the mean and covariance, odd ones set the limit."""
    parts: list[list[torch.Tensor]] = [[], []]
    while sum(map(len, parts)) < settings.gate_texts:
        logits, context, _ = logged_text(service, texts, settings.seq_tokens)
        with torch.no_grad():
            inputs = router.inputs(torch.log_softmax(logits.float(), dim=-1), context)  # (n, F)
        parts[sum(map(len, parts)) % 2].append(inputs)
    gate = FamiliarityGate.fit(torch.cat(parts[0]), torch.cat(parts[1]), settings.generalist)
    logger.info("router: familiarity gate fitted on %d positions (limit %.2f)", len(torch.cat(parts[0])), gate.limit)
    return gate


def prepare_router(service: FusionService, settings: RouterTrainSettings | None = None) -> Path:
    """Train the service's `router: auto` router unless one is shipped for its experts or the cache has it
    (default: the built-in mix, 450 texts; minutes on 2 CPU cores)."""
    path = service.auto_router_checkpoint()
    if not path.is_file():
        settings = settings or RouterTrainSettings(minutes=30.0, max_texts=450)
        logger.info("training the router for experts %s once (%d texts); it is cached at %s",
                    service.expert_names, settings.max_texts or 0, path)
        train_router(service, path, settings=settings)
    return path
