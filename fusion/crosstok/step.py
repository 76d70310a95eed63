"""Cross-tokenizer fusion: experts with different tokenizers decode one text together.

The fused distribution is over text (bytes). Each expert keeps its own ids for the text it has
committed (its prompt with its own chat template, then ids it chose) and the *pending* bytes after
them: the shared text's tail that it has not split into ids yet (usually the last piece: " wor"
might still become " world"). Only new ids are ever computed: experts cache each session's prefix.

One step, for a sequence whose experts hold (ids_e, u_e):
  1. each expert's next-token row after ids_e (`Expert.extend` with the empty extension; free when the
     previous step looked ahead at the path the expert has now committed)
  2. candidates, first pass: every single byte, plus each expert's `top_k` likeliest pieces (the bytes
     its likely ids add after u_e)
  3. lookahead, one batched `extend` call per expert: rows after each *spelling path* π (ids whose
     bytes are a prefix of the text to come) that may carry mass: the ids that spell a prefix of u_e
     (u_e itself included), the ids longer than u_e that spell a proper prefix of u_e + a candidate,
     and the expert's own tokenizer spelling of u_e and of u_e + each multi-byte candidate (multi-id
     paths: "'s" after " Python" is "'" then "s" for Gemma). Paths lighter than `min_path_prob` times
     the mass of u_e are skipped
  4. candidates, second pass: each expert's likeliest ids after its spellings of u_e; an expert that
     cannot spell a new piece with its paths gets its tokenizer's spelling of it in a second call
  5. each expert's prefix mass of every candidate, counting every way it spells it:
        Q_e(x) = Σ_{π: bytes(π) a proper prefix of x} P(π) · Σ_{t: bytes(t) starts with x[|π|:]} p(t | π)
     (the inner sum is a range of the ids sorted by bytes: one cumulative sum per row, over the span
     where that row's ranges fall)
  6. events partition the continuations by their longest candidate prefix: event c has mass
     Q_e(u_e c) - Σ_{children c'} Q_e(u_e c'), over Q_e(u_e); END has the mass of u_e's spellings
     followed by an end-of-sequence id. Single bytes guarantee every continuation an event, so a text's
     probability is the product of its pieces' and bits per byte are well defined whoever spells it.
     The chosen event rules out the candidates that extend it: the next step gives them no mass
     (`exclusions_after`), which keeps the product exact
  7. the rule fuses the experts' event log-probabilities `(E, 1, C+1)`; the sampler picks an event;
     its bytes are appended and each expert commits the spelling path that carried most of the new
     text's mass (none while one id of its own could still cover all of it)
With `CrossParams.exact()` (deep lookahead, no pruning) the masses are exact byte-level prefix
probabilities (Phan et al. 2024) given each expert's committed ids; tests check them against a brute
force over every spelling. Serving uses one batched lookahead call per expert and step.

This module holds one step's machinery (`CrossTokenizerFusion`, each expert's `ExpertState`);
`fusion.crosstok.decode` runs it over a request: generating (`decode`) and teacher-forced scoring
(`score_text`).
"""

from __future__ import annotations

import bisect
import math
import uuid
from dataclasses import dataclass, field
from typing import Sequence

import torch

from fusion.compute import one_thread
from fusion.experts.expert import Expert
from fusion.crosstok.spelling import Spelling

END = None  # the end-of-text event's piece
_FLOOR = 1e-30  # smallest event mass (a truncated lookahead can leave a child heavier than its parent)


@dataclass(frozen=True)
class CrossParams:
    """How much work one step may do. The defaults serve; tests set `exact()`."""

    top_k: int = 8  # candidate pieces per expert, besides every single byte
    min_path_prob: float = 1e-3  # spelling paths lighter than this are not looked ahead
    max_paths: int = 8  # rows looked ahead per expert per level
    depth: int = 1  # lookahead levels (ids before the one that covers a piece's end)
    # "spelling" (this module's alignment) or "exact_match": the GaC-style baseline kept for measuring
    # against it: each expert conditions on its tokenizer's encoding of all the text, a piece's
    # probability is that of the id spelling exactly it (0 without one), no lookahead.
    alignment: str = "spelling"

    def __post_init__(self) -> None:
        if self.alignment not in ("spelling", "exact_match"):
            raise ValueError(f"alignment: 'spelling' or 'exact_match', got {self.alignment!r}")

    @classmethod
    def exact(cls, top_k: int = 8) -> CrossParams:
        return cls(top_k=top_k, min_path_prob=0.0, max_paths=4096, depth=64)


@dataclass
class _Row:
    """One next-token distribution, indexed for prefix queries over a span [lo, hi) of the ids sorted by
    bytes: the ids that start with the pending text after the row's path, where its queries fall (every
    id for the path that spells all of it; a narrow range for shorter paths). A query outside the span
    (a path longer than the pending text) sums its range directly."""

    logp: torch.Tensor  # (V,) float32 log-probabilities
    sorted_ids: torch.Tensor  # (N,) long: the spelling's ids sorted by bytes
    lo: int
    sorted_logp: torch.Tensor  # (hi - lo,) float32: logp over sorted_ids[lo:hi]
    csum: torch.Tensor  # (hi - lo + 1,) float64: cumulative probabilities over sorted_ids[lo:hi]

    @classmethod
    def batch(cls, logits: torch.Tensor, spelling: Spelling, spans: Sequence[tuple[int, int]]) -> list[_Row]:
        """The rows of logits (k, V'), V' >= the spelling's V, each indexed over its span. On one thread:
        the ops are memory-bound; on a shared host a second thread only adds a wait for it."""
        rows = []
        with one_thread():
            logp = torch.log_softmax(logits[:, : spelling.vocab_size].float(), dim=-1)  # (k, V), one op for all
            for j, (lo, hi) in enumerate(spans):
                sorted_logp = logp[j].index_select(0, spelling.sorted_ids[lo:hi])  # (hi - lo,)
                csum = sorted_logp.new_zeros(hi - lo + 1, dtype=torch.float64)
                torch.cumsum(sorted_logp.exp(), dim=0, dtype=torch.float64, out=csum[1:])
                rows.append(cls(logp[j], spelling.sorted_ids, lo, sorted_logp, csum))
        return rows

    @property
    def hi(self) -> int:
        return self.lo + len(self.sorted_logp)

    def mass(self, lo: int, hi: int) -> float:
        """The probability of sorted ids [lo, hi)."""
        if self.lo <= lo and hi <= self.hi:
            return float(self.csum[hi - self.lo] - self.csum[lo - self.lo])
        if hi <= lo:
            return 0.0
        return float(self.logp[self.sorted_ids[lo:hi]].exp().double().sum())

    def span_masses(self, lows: torch.Tensor, highs: torch.Tensor) -> torch.Tensor:
        """`mass` of each range [lows[t], highs[t]) (long tensors): (T,) float64."""
        if len(lows) and int(lows.min()) >= self.lo and int(highs.max()) <= self.hi:
            return self.csum[highs - self.lo] - self.csum[lows - self.lo]
        return torch.tensor([self.mass(lo, hi) for lo, hi in zip(lows.tolist(), highs.tolist())], dtype=torch.float64)

    def top(self, lo: int, hi: int, k: int) -> tuple[list[float], list[int]]:
        """The `k` likeliest ids among sorted ids [lo, hi): (log-probabilities, ids)."""
        if self.lo <= lo and hi <= self.hi:
            values = self.sorted_logp[lo - self.lo: hi - self.lo]
        else:
            values = self.logp[self.sorted_ids[lo:hi]]
        with one_thread():
            top = torch.topk(values, min(k, hi - lo))
        return top.values.tolist(), self.sorted_ids[lo:hi][top.indices].tolist()


@dataclass
class _Path:
    tokens: tuple[int, ...]
    text: bytes  # the bytes the tokens spell
    logp: float  # log P(tokens | ids)
    row: _Row | None = None  # the next-token distribution after them (None: not computed)


@dataclass
class ExpertState:
    """One expert's view of one sequence: its own ids for the text it has committed, and the pending
    bytes after them. `ids` spell the shared text's start and `pending` the rest, always."""

    index: int
    expert: Expert
    spelling: Spelling
    session: str
    ids: list[int]  # prompt ids + the ids committed since
    start: int  # ids[start:] spell the shared text that follows the prompt (with `pending`)
    pending: bytes = b""  # the shared text the ids do not cover yet
    paths: dict[tuple[int, ...], _Path] = field(default_factory=dict)

    def text(self) -> bytes:
        """The shared text as this expert holds it: its committed ids' bytes, then the pending ones."""
        return self.spelling.spell(self.ids[self.start:]) + self.pending

    def advance(self, piece: bytes, *, commit_all: bool = False) -> None:
        """Append `piece` to the shared text. The expert commits its own most probable spelling of the
        new pending text among the paths this step computed (the path with the largest share of the
        piece's mass: a path that spells a proper prefix of it, times the mass of ids that start with the
        rest); the bytes after that path stay pending. Committed ids are never rewritten, so only new ids
        are computed; a pending text longer than any token is committed by the tokenizer."""
        text = self.pending + piece
        if commit_all:  # the baseline: the tokenizer's encoding of the new text, nothing held back
            ids, self.pending = self.spelling.tokenize(text)
            self.ids = self.ids + ids
            self.paths = {}
            return
        best, best_logp = (), -math.inf
        for path in self.paths.values():
            if not path.tokens or path.row is None or not text.startswith(path.text):
                continue
            if len(path.text) == len(text):
                logp = path.logp
            else:
                lo, hi = self.spelling.range_of(text[len(path.text):])
                logp = path.logp + math.log(max(path.row.mass(lo, hi), 1e-300))
            if logp > best_logp:
                best, best_logp = path.tokens, logp
        root, root_logp = self.paths.get(()), -math.inf
        if root is not None and root.row is not None:
            lo, hi = self.spelling.range_of(text)
            root_logp = math.log(max(root.row.mass(lo, hi), 1e-300))
            if root_logp >= best_logp:
                best = ()  # one id of the expert's will spell all of it: wait for it
        if max(best_logp, root_logp) < -600:  # no computed path spells it: the tokenizer commits
            ids, rest = self.spelling.tokenize(text)
            best = tuple(ids if rest else ids[:-1])
        committed = self.spelling.spell(best)
        self.ids = self.ids + list(best)
        self.pending = text[len(committed):]
        if len(self.pending) > self.spelling.max_token_bytes:  # no single id can cover it any more
            ids, rest = self.spelling.tokenize(self.pending)
            keep = ids[:-1]
            self.ids += keep
            self.pending = self.pending[len(self.spelling.spell(keep)):]
        self.paths = {}


@dataclass
class StepEvents:
    pieces: list[bytes | None]  # the step's events: candidate pieces, then END (None)
    logprobs: torch.Tensor  # (E, C + 1) each consulted expert's event log-probabilities
    fused: torch.Tensor  # (C + 1,) fused log-space scores
    weights: torch.Tensor  # (E,) the weights the rule used


class CrossTokenizerFusion:
    """Runs the experts of one request over shared text; `step` does steps 1-5 above, `events_for`
    exposes the per-expert event distribution (for tests and scoring)."""

    def __init__(self, experts: Sequence[Expert], spellings: Sequence[Spelling], params: CrossParams | None = None
                 ) -> None:
        if len(experts) != len(spellings):
            raise ValueError("one spelling per expert is required")
        self.experts = list(experts)
        self.spellings = list(spellings)
        self.params = params or CrossParams()

    # -- sequences --------------------------------------------------------------------------
    def open(self, prompt_ids: Sequence[Sequence[int]], used: Sequence[bool], *, hold_back_prompt: bool = False
             ) -> list[ExpertState]:
        """One state per consulted expert. `hold_back_prompt`: a plain text prompt's last id becomes
        pending text (so "The answer is " or "12" can merge with what follows, as the expert would spell it)."""
        session = f"xtok-{uuid.uuid4().hex[:16]}"
        states = []
        for i, (expert, spelling, prompt) in enumerate(zip(self.experts, self.spellings, prompt_ids)):
            if not used[i]:
                continue
            prompt = list(prompt)
            held = spelling.token_bytes[prompt[-1]] if hold_back_prompt and len(prompt) > 1 else b""
            ids = prompt[:-1] if held else prompt
            states.append(ExpertState(i, expert, spelling, session, ids, len(ids), held))
        return states

    def close(self, states: Sequence[ExpertState]) -> None:
        for state in states:
            state.expert.release([state.session])

    # -- one step ---------------------------------------------------------------------------
    def events(self, states: Sequence[ExpertState], excluded: Sequence[bytes] = ()
               ) -> tuple[list[bytes | None], torch.Tensor]:
        """The step's events and each state's log-probabilities of them: (pieces, (len(states), C + 1)).
        `excluded`: continuations the previous step's event ruled out (`exclusions_after`); their
        events get no mass and the rest are renormalized."""
        for state in states:
            self._root(state)
        if self.params.alignment == "exact_match":
            pieces = sorted(set(self._candidates(states)))
            return list(pieces) + [END], torch.stack([self._exact_match_logprobs(s, pieces) for s in states])
        pieces = set(self._candidates(states)) | set(excluded)  # from each expert's next-token row
        for state in states:
            self._look_ahead(state, sorted(pieces))
        first = pieces
        pieces = sorted(pieces | set(self._candidates(states)))  # and from the rows after u's spellings
        if self.params.depth == 1:  # pieces new in this pass that an expert spells with several ids
            added = [p for p in pieces if p not in first and len(p) > 1]
            for state in states:
                self._add_canonical(state, [state.pending + p for p in added])
        if self.params.depth > 1:
            for state in states:
                self._look_ahead_candidates(state, pieces)
        rows = [self._event_logprobs(state, pieces, excluded) for state in states]
        return list(pieces) + [END], torch.stack(rows)

    def _exact_match_logprobs(self, state: ExpertState, pieces: Sequence[bytes]) -> torch.Tensor:
        """The GaC-style baseline: P(piece) = p(the id spelling exactly pending + piece); END = p(eos)."""
        return _exact_match_logprobs_impl(state, pieces)

    def _compute(self, state: ExpertState, paths: list[_Path]) -> None:
        """Rows after each path (one batched `extend` call)."""
        if not paths:
            return
        logits = state.expert.extend(state.session, state.ids, [list(p.tokens) for p in paths])  # (k, V)
        spans = [self._span(state, path) for path in paths]
        for path, row in zip(paths, _Row.batch(logits, state.spelling, spans)):
            path.row = row

    @staticmethod
    def _span(state: ExpertState, path: _Path) -> tuple[int, int]:
        """Where the queries on the row after `path` fall: the ids that start with the pending text after
        it (all of them for the path that spells it all); none for a path longer than the pending text."""
        u = state.pending
        return state.spelling.range_of(u[len(path.text):]) if u.startswith(path.text) else (0, 0)

    def _root(self, state: ExpertState) -> _Path:
        root = state.paths.get(())
        if root is None:
            root = state.paths[()] = _Path((), b"", 0.0)
            self._compute(state, [root])
        return root

    def _grow_paths(self, state: ExpertState, frontier: list[_Path], targets: Sequence[bytes], *, inclusive: bool
                    ) -> list[_Path]:
        """The new paths one id longer than `frontier`'s whose bytes are a prefix of a target (a proper one
        unless `inclusive`) and whose probability is at least `min_path_prob`. Rows not computed."""
        spelling = state.spelling
        found: dict[tuple[int, ...], _Path] = {}
        for path in frontier:
            for target in targets:
                rest = target[len(path.text):]
                if not rest or not target.startswith(path.text):
                    continue
                for n, token in spelling.prefix_tokens(rest, proper=not inclusive):
                    tokens = path.tokens + (token,)
                    if tokens in state.paths or tokens in found:
                        continue
                    logp = path.logp + float(path.row.logp[token])
                    if logp > -math.inf:
                        found[tokens] = _Path(tokens, path.text + rest[:n], logp)
        return list(found.values())

    def _add(self, state: ExpertState, paths: list[_Path]) -> list[_Path]:
        """Keep the `max_paths` heaviest of `paths`, compute their rows in one call, register them."""
        chosen = sorted(paths, key=lambda p: -p.logp)[: self.params.max_paths]
        self._compute(state, chosen)
        for path in chosen:
            state.paths[path.tokens] = path
        return chosen

    def _look_ahead(self, state: ExpertState, pieces: Sequence[bytes]) -> None:
        """Level 1, one batched call: the ids that spell a prefix of the pending bytes u (u itself
        included), and the ids longer than u that spell a proper prefix of u + a candidate (a piece
        another expert spells with one id, this one with two). Only paths of at least `min_path_prob`
        times the heaviest way to start u are kept: what matters is a path's share of u's mass, the
        step's denominator. Deeper levels (`depth` > 1) complete u's spellings."""
        root = state.paths[()]
        params, spelling, u = self.params, state.spelling, state.pending
        level = self._grow_paths(state, [root], [u], inclusive=True) if u else []
        lo, hi = spelling.range_of(u)
        # u's mass is at least that of the ids that start with it (u itself among them); a path adds at
        # most its own probability, so one lighter than `min_path_prob` times that adds at most that share
        reference = math.log(max(root.row.mass(lo, hi), 1e-300))
        floor = reference + math.log(params.min_path_prob) if params.min_path_prob > 0 else -math.inf
        level = [p for p in level if p.logp >= floor]
        if params.depth == 1:
            longer = [(n, token) for piece in pieces for n, token in spelling.prefix_tokens(u + piece) if n > len(u)]
            for n, token in set(longer):
                logp = float(root.row.logp[token])
                if logp >= floor and (token,) not in state.paths:
                    level.append(_Path((token,), spelling.token_bytes[token], logp))
        chosen = sorted(level, key=lambda p: -p.logp)[: params.max_paths]
        if params.depth == 1:  # plus the tokenizer's own spelling of u and of u + each multi-byte piece
            chosen += self._canonical_paths(state, [u] + [u + p for p in pieces if len(p) > 1],
                                            {p.tokens for p in chosen})
        self._register(state, chosen)
        frontier = [p for p in chosen if len(p.tokens) == 1 and len(p.text) < len(u) and u.startswith(p.text)]
        for _ in range(1, params.depth):
            if not frontier:
                break
            grown = self._add(state, self._grow_paths(state, frontier, [u], inclusive=True))
            frontier = [p for p in grown if len(p.text) < len(u)]

    def _register(self, state: ExpertState, paths: list[_Path]) -> None:
        """Compute the rows after `paths` (one call), keep them, and give every path its probability from
        its parent's row (the root's for one id; canonical spellings are made without one)."""
        self._compute(state, paths)
        for path in paths:
            state.paths[path.tokens] = path
        for path in sorted(paths, key=lambda p: len(p.tokens)):
            parent = state.paths[path.tokens[:-1]]
            path.logp = parent.logp + float(parent.row.logp[path.tokens[-1]])

    def _add_canonical(self, state: ExpertState, targets: Sequence[bytes]) -> None:
        """A second call, only when needed: the canonical spelling of targets this expert cannot spell
        with the paths it has (no path is a proper prefix from which one id covers the rest)."""
        spelling, missing = state.spelling, []
        for target in targets:
            covered = False
            for path in state.paths.values():
                if path.row is not None and len(path.text) < len(target) and target.startswith(path.text):
                    lo, hi = spelling.range_of(target[len(path.text):])
                    if hi > lo:
                        covered = True
                        break
            if not covered:
                missing.append(target)
        if missing:
            self._register(state, self._canonical_paths(state, missing, set()))

    def _canonical_paths(self, state: ExpertState, targets: Sequence[bytes], have: set) -> list[_Path]:
        """Serving's second level, in the same batched call: for each target the ids the expert's own
        tokenizer spells it with, but the last (the one that covers its end), and their prefixes: the
        spelling an expert most likely gives a piece that it needs several ids for ("'s" after
        " Python": "'" then "s"). At most `max_paths` new paths; probabilities are filled in once the
        rows are computed."""
        spelling, found = state.spelling, []
        for target in targets:
            ids, rest = spelling.tokenize(target)
            path = tuple(ids if rest else ids[:-1])
            for n in range(1, len(path) + 1):
                tokens = path[:n]
                if tokens not in have and tokens not in state.paths:
                    have.add(tokens)
                    found.append(_Path(tokens, spelling.spell(tokens), 0.0))
            if len(found) >= self.params.max_paths:
                break
        return found[: self.params.max_paths]

    def _look_ahead_candidates(self, state: ExpertState, pieces: Sequence[bytes]) -> None:
        """Deeper levels (`depth` > 1): paths that spell a proper prefix of u + piece."""
        targets = [state.pending + piece for piece in pieces]
        frontier = [p for p in state.paths.values() if p.row is not None]
        top = max(p.logp for p in frontier)
        floor = top + math.log(self.params.min_path_prob) if self.params.min_path_prob > 0 else -math.inf
        for _ in range(self.params.depth):
            grown = [p for p in self._grow_paths(state, frontier, targets, inclusive=False) if p.logp >= floor]
            frontier = self._add(state, grown)
            if not frontier:
                break

    def _candidates(self, states: Sequence[ExpertState]) -> list[bytes]:
        """Every single byte, plus each expert's `top_k` heaviest pieces after its pending bytes."""
        pieces = {bytes([b]) for b in range(256)}
        for state in states:
            spelling, u = state.spelling, state.pending
            scored: dict[bytes, float] = {}
            for path in state.paths.values():
                if path.row is None or not u.startswith(path.text):
                    continue
                rest = u[len(path.text):]
                lo, hi = spelling.range_of(rest)
                if hi <= lo:
                    continue
                for value, token in zip(*path.row.top(lo, hi, self.params.top_k + 1)):
                    piece = spelling.token_bytes[token][len(rest):]
                    if piece:
                        scored[piece] = max(scored.get(piece, -math.inf), path.logp + value)
            pieces.update(sorted(scored, key=lambda p: -scored[p])[: self.params.top_k])
        return sorted(pieces)

    def _piece_masses(self, state: ExpertState, pieces: Sequence[bytes]) -> tuple[torch.Tensor, float]:
        """Q_e(u + piece) for each piece of the sorted `pieces`, (P,) float64, and Q_e(u) (1 for an empty u):
        for every path with a row, its probability times the mass its row puts on the ids that start with
        the rest of each target. A path inside u reaches every target: the single bytes' ranges come from
        one remembered `byte_bounds` row, their masses from one indexing of the row's cumulative sums."""
        spelling, u = state.spelling, state.pending
        singles = [j for j, piece in enumerate(pieces) if len(piece) == 1]
        single_bytes = torch.tensor([pieces[j][0] for j in singles], dtype=torch.long)
        multi = [j for j, piece in enumerate(pieces) if len(piece) > 1]
        total = torch.zeros(len(pieces), dtype=torch.float64)
        u_mass = 0.0 if u else 1.0
        for path in state.paths.values():
            if path.row is None:
                continue
            weight = math.exp(path.logp)
            if u.startswith(path.text):  # every target u + piece extends this path's text
                rest = u[len(path.text):]
                lows = torch.empty(len(pieces), dtype=torch.long)
                highs = torch.empty(len(pieces), dtype=torch.long)
                bounds = spelling.byte_bounds(rest)  # (257,)
                lows[singles], highs[singles] = bounds[single_bytes], bounds[single_bytes + 1]
                for j in multi:
                    lows[j], highs[j] = spelling.range_of(rest + pieces[j])
                total += weight * path.row.span_masses(lows, highs)
                if rest:
                    u_mass += weight * path.row.mass(*spelling.range_of(rest))
            elif path.text.startswith(u):  # a path into the pieces: the targets that extend past its text
                s = path.text[len(u):]
                for j in range(bisect.bisect_left(pieces, s), len(pieces)):
                    if not pieces[j].startswith(s):
                        break
                    if len(pieces[j]) > len(s):
                        total[j] += weight * path.row.mass(*spelling.range_of(pieces[j][len(s):]))
        return total, u_mass

    def _event_logprobs(self, state: ExpertState, pieces: Sequence[bytes], excluded: Sequence[bytes] = ()
                        ) -> torch.Tensor:
        """log P_e(event) for each piece, then END: (C + 1,) float32."""
        u = state.pending
        masses, denominator = self._piece_masses(state, pieces)
        index = {piece: j for j, piece in enumerate(pieces)}
        events = masses.clone()
        for j, piece in enumerate(pieces):  # subtract each piece's mass from its longest candidate prefix
            for n in range(len(piece) - 1, 0, -1):
                parent = index.get(piece[:n])
                if parent is not None:
                    events[parent] -= masses[j]
                    break
        for x in excluded:  # ruled out: its events get nothing, and its mass leaves the denominator
            if not any(x.startswith(y) and len(y) < len(x) for y in excluded):
                denominator -= float(masses[index[x]])
        for j, piece in enumerate(pieces):
            if any(piece.startswith(x) for x in excluded):
                events[j] = 0.0
        end = 0.0
        eos = list(state.expert.info.eos_token_ids)
        if eos:
            for path in state.paths.values():
                if path.row is not None and path.text == u:
                    end += math.exp(path.logp) * float(path.row.logp[eos].double().exp().sum())
        events = torch.cat([events, torch.tensor([end], dtype=torch.float64)])
        return (events.clamp(min=_FLOOR) / max(denominator, _FLOOR)).log().float()


def _exact_match_logprobs_impl(state: ExpertState, pieces: Sequence[bytes]) -> torch.Tensor:
    row = state.paths[()].row
    probs = []
    for piece in pieces:
        ids = state.spelling.ids_of(state.pending + piece)
        probs.append(float(row.logp[ids].double().exp().sum()) if ids else 0.0)
    eos = list(state.expert.info.eos_token_ids)
    probs.append(float(row.logp[eos].double().exp().sum()) if eos and not state.pending else 0.0)
    return torch.tensor(probs, dtype=torch.float64).clamp(min=_FLOOR).log().float()


def exclusions_after(pieces: Sequence[bytes | None], choice: int) -> list[bytes]:
    """What the chosen event rules out for the text after its piece: the event "starts with c and not
    with a longer candidate" excludes every candidate (and earlier exclusion) that extends c."""
    chosen = pieces[choice]
    if chosen is None:
        return []
    return [p[len(chosen):] for p in pieces if p is not None and len(p) > len(chosen) and p.startswith(chosen)]
