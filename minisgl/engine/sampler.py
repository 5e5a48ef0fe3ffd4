"""Turn a batch of logits into next tokens.

For each request (row), with ``V = vocab_size`` (columns ``>= V`` never take part)::

    raw logits
      -> repetition penalty  (tokens of prompt + output: positive / r, negative * r)
      -> frequency, presence (output tokens: - count * frequency - presence)
      -> banned ids = -inf                                = "penalized logits" z
    logprobs: log_softmax(z), temperature and filters not applied
    greedy (temperature < 1e-5 or top_k == 1): argmax z
    sampled: w = exp((z - max z) / T)                     (unnormalized; max w == 1)
      -> keep w >= max(top_k cut, top_p cut, min_p)       (cuts: see ``_cut_from_sorted``)
      -> inverse CDF over the kept tokens in token-id order, one uniform u per row

The uniform of a seeded row comes from a generator seeded with ``hash(seed, len(output_ids))``,
and everything after it reads only that row, so its token does not depend on the rest of the
batch. Unseeded rows share one generator.

Speed on CPU, where ``argmax``, ``topk`` and ``sort`` over a 50k vocabulary cost 0.1-5 ms per
row and random fills 0.2-1 ms: the vocabulary is cut into blocks of ``BLOCK`` tokens; argmax,
top-N and the top-k / top-p cuts first look only at the blocks whose maximum can matter; the
draw needs one uniform per row and picks a block by its mass, then a token inside it. Every
full-vocabulary pass is one vectorized op over all rows that need it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from itertools import chain

import numpy as np
import torch

from minisgl.engine.batch import BatchOutput, SampleInfo
from minisgl.sampling_params import SamplingParams

BLOCK = 64
GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are treated as greedy (``exp(z / T)`` would overflow)."""

_CUT_BLOCKS = 16
"""Blocks with the largest maxima ranked first for the top-k / top-p cut."""
_CUT_PREFIXES = (1024, 8192)
"""Sorted prefix lengths of the whole row tried next, before a full sort."""
_DRAW_GROUPS = (16, 256)
"""Rows whose kept tokens lie in at most this many blocks draw from those blocks only."""
_SLACK = 1.0 - 2.0**-20
"""Block maxima of the weights are computed apart from the weights: allow a few ulps."""
_EXP_FLOOR = -87.0
"""exp() of anything lower is subnormal or zero, and slow to compute."""
_MASK64 = (1 << 64) - 1


def is_greedy(params: SamplingParams) -> bool:
    """Whether the sampler takes the argmax for these parameters."""
    return params.temperature < GREEDY_TEMPERATURE or params.top_k == 1


def seed_for_step(seed: int, step: int) -> int:
    """A well-mixed 64-bit generator seed for request ``seed`` at output position ``step``."""

    def splitmix64(z: int) -> int:
        z = (z + 0x9E3779B97F4A7C15) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    return splitmix64(splitmix64(seed & _MASK64) ^ step)


def fast_argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of the first maximum of each row of a 2-D tensor, like ``x.argmax(-1)``.

    On CPU ``argmax`` is not vectorized; a block ``amax`` followed by an argmax over block
    maxima and one inside the winning block returns the same index several times faster.
    """
    n, width = x.shape
    main = width - width % BLOCK
    if x.device.type != "cpu" or main == 0 or x.stride(-1) != 1:
        return x.argmax(-1)
    blocks = x[:, :main].view(n, main // BLOCK, BLOCK)
    block_max = blocks.amax(-1)
    best = block_max.argmax(-1, keepdim=True)
    inner = _gather_blocks(blocks, best).squeeze(1).argmax(-1, keepdim=True)
    idx = (best * BLOCK + inner).squeeze(1)
    if main < width:
        tail_max, tail_idx = x[:, main:].max(-1)
        idx = torch.where(tail_max > block_max.gather(1, best).squeeze(1), tail_idx + main, idx)
    return idx


def block_topk(
    x: torch.Tensor,
    k: int,
    rows: torch.Tensor | None = None,
    block_max: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x[rows].topk(k, -1)`` (values descending) for 2-D ``x`` (``rows`` None: all rows).

    The k largest values lie in the k blocks with the largest maxima (``block_max`` of those
    rows, computed when None), so only those ``k * BLOCK`` candidates are ranked. Values are
    exact; the order of equal values is not.
    """
    width = x.shape[1]
    num_blocks = width // BLOCK
    if width % BLOCK or x.stride(-1) != 1 or 4 * k > num_blocks:
        return (x if rows is None else x[rows]).topk(k, -1)
    blocks = x.view(x.shape[0], num_blocks, BLOCK)
    if rows is None:
        rows = torch.arange(x.shape[0], device=x.device)
    if block_max is None:
        block_max = blocks[rows].amax(-1)
    top_blocks = block_max.topk(k, -1).indices
    values, pos = blocks[rows[:, None], top_blocks].view(rows.numel(), k * BLOCK).topk(k, -1)
    return values, top_blocks.gather(1, pos // BLOCK) * BLOCK + pos % BLOCK


def penalty_patch(
    x: torch.Tensor, infos: Sequence[SampleInfo], rows: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, column, new value) of every entry of ``x`` the penalties of ``rows`` change.

    Repetition (HF / CTRL) covers the distinct tokens of prompt and output: a positive logit
    is divided by the penalty, a negative one multiplied. Then frequency and presence (OpenAI)
    cover output tokens: ``logit -= count * frequency_penalty + presence_penalty``. Token ids
    outside ``[0, x.shape[1])`` are ignored.
    """
    width, device = x.shape[1], x.device
    rep_rows = [r for r in rows if infos[r].params.repetition_penalty != 1.0]
    out_lens = [len(infos[r].output_ids) for r in rows]
    ids = torch.tensor(
        list(
            chain(
                chain.from_iterable(infos[r].output_ids for r in rows),
                chain.from_iterable(infos[r].prompt_ids for r in rep_rows),
            )
        ),
        dtype=torch.int64,
    )
    owner = torch.repeat_interleave(
        torch.tensor(list(rows) + rep_rows, dtype=torch.int64),
        torch.tensor(out_lens + [len(infos[r].prompt_ids) for r in rep_rows], dtype=torch.int64),
    )
    is_out = torch.arange(ids.numel()) < sum(out_lens)
    valid = (ids >= 0) & (ids < width)
    if not bool(valid.all()):
        ids, owner, is_out = ids[valid], owner[valid], is_out[valid]
    flat, inverse = torch.unique((owner * width + ids).to(device), return_inverse=True)
    counts = torch.zeros(flat.numel(), dtype=x.dtype, device=device)
    counts.index_add_(0, inverse, is_out.to(device=device, dtype=x.dtype))
    row, col = flat // width, flat % width

    table = [
        (p.repetition_penalty, p.frequency_penalty, p.presence_penalty) for p in _params(infos)
    ]
    rep, freq, pres = torch.tensor(table, dtype=x.dtype).to(device)[row].unbind(1)
    vals = x[row, col]
    vals = torch.where(vals > 0, vals / rep, vals * rep)
    vals = vals - counts * freq - (counts > 0).to(x.dtype) * pres
    return row, col, vals


def apply_penalties(x: torch.Tensor, infos: Sequence[SampleInfo], rows: Sequence[int]) -> None:
    """Apply the penalties of ``rows`` to ``x`` in place (see ``penalty_patch``)."""
    if rows:
        row, col, vals = penalty_patch(x, infos, rows)
        x[row, col] = vals


def ban_positions(
    infos: Sequence[SampleInfo], rows: Sequence[int], width: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of every banned token of ``rows`` that lies in ``[0, width)``."""
    pairs = [(r, t) for r in rows for t in infos[r].banned_token_ids if 0 <= t < width]
    both = torch.tensor(pairs, dtype=torch.int64).view(-1, 2).to(device)
    return both[:, 0], both[:, 1]


class Sampler:
    """Samples one token per request from ``[len(infos), >= vocab_size]`` logits.

    ``seed`` fixes the generator shared by unseeded requests (tests); None seeds it randomly.
    """

    def __init__(self, vocab_size: int, device: torch.device, seed: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.width = -(-vocab_size // BLOCK) * BLOCK
        self._shared = torch.Generator()
        if seed is None:
            self._shared.seed()
        else:
            self._shared.manual_seed(seed & _MASK64)
        self._seeded = torch.Generator()
        self._buffers: dict[str, torch.Tensor] = {}

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, infos: Sequence[SampleInfo]) -> BatchOutput:
        """Next token per row; log-probabilities when any request asks for them.

        ``logits``: float ``[len(infos), >= vocab_size]`` on any device. Penalties and bans
        are written into it and undone before returning when it is float32 and ``vocab_size``
        is a multiple of ``BLOCK``; otherwise a copy is used.
        ``BatchOutput.logprobs`` / ``top_logprobs`` are None unless some request has
        ``params.logprobs is not None``; then they hold one entry per row: ``nan`` / ``[]`` for
        rows that did not ask, ``[]`` alternatives for ``logprobs == 0``, else ``(token,
        logprob)`` pairs sorted by descending logprob (ties by token id). Log-probabilities are
        ``log_softmax`` of the penalized logits (banned tokens have ``-inf``). Undefined when
        every token of a row is banned.
        """
        n = len(infos)
        if logits.dim() != 2 or logits.shape[0] != n or logits.shape[1] < self.vocab_size:
            raise ValueError(
                f"logits of shape {tuple(logits.shape)} do not match {n} requests "
                f"and vocab size {self.vocab_size}"
            )
        greedy: list[int] = []
        sampled: list[int] = []
        penalized: list[int] = []
        banned: list[int] = []
        with_logprobs: list[int] = []
        for i, info in enumerate(infos):
            p = info.params
            (greedy if is_greedy(p) else sampled).append(i)
            if p.has_penalties:
                penalized.append(i)
            if info.banned_token_ids:
                banned.append(i)
            if p.logprobs is not None:
                with_logprobs.append(i)
        if not sampled and not penalized and not banned and not with_logprobs:
            return BatchOutput(next_token_ids=fast_argmax(logits[:, : self.vocab_size]).tolist())

        bans = ban_positions(infos, banned, self.vocab_size, logits.device) if banned else None
        x, restore = self._penalized_logits(logits, infos, penalized, bans)
        try:
            x_block_max = x.view(n, -1, BLOCK).amax(-1)
            next_ids = torch.empty(n, dtype=torch.int64, device=x.device)
            if greedy:
                g = _index(greedy, x.device)
                best = x_block_max[g].argmax(-1)
                inner = x.view(n, -1, BLOCK)[g, best].argmax(-1)
                next_ids[g] = best * BLOCK + inner
            if sampled:
                s = _index(sampled, x.device)
                next_ids[s] = self._sample_rows(x, x_block_max, sampled, infos, bans)
            if not with_logprobs:
                return BatchOutput(next_token_ids=next_ids.tolist())
            return self._with_logprobs(x, x_block_max, infos, with_logprobs, next_ids)
        finally:
            restore()

    def _buffer(self, name: str, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        """A reused float32 ``[rows, cols]`` scratch tensor (a fresh multi-MB CPU allocation
        page-faults on every call)."""
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < rows * cols or buf.device != device:
            buf = torch.empty(rows * cols, dtype=torch.float32, device=device)
            self._buffers[name] = buf
        return buf[: rows * cols].view(rows, cols)

    def _penalized_logits(
        self,
        logits: torch.Tensor,
        infos: Sequence[SampleInfo],
        penalized: list[int],
        bans: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, Callable[[], None]]:
        """``[n, width]`` float32 penalized logits (columns ``>= vocab_size`` at ``-inf``) and
        the function that undoes any change made to ``logits``."""
        vocab, width, device = self.vocab_size, self.width, logits.device
        in_place = vocab == width and logits.dtype == torch.float32
        if in_place:
            x = logits[:, :vocab]
        else:
            x = self._buffer("logits", logits.shape[0], width, device)
            x[:, :vocab] = logits[:, :vocab]
            x[:, vocab:] = -math.inf
        patch = penalty_patch(x, infos, penalized) if penalized else None
        touched = ([patch[:2]] if patch else []) + ([bans] if bans else [])
        saved = [(r, c, x[r, c]) for r, c in touched] if in_place else []
        if patch is not None:
            x[patch[0], patch[1]] = patch[2]
        if bans is not None:
            x[bans[0], bans[1]] = -math.inf

        def restore() -> None:
            for r, c, old in saved:
                x[r, c] = old

        return x, restore

    def _uniforms(self, infos: Sequence[SampleInfo], device: torch.device) -> torch.Tensor:
        unseeded = sum(info.params.seed is None for info in infos)
        shared = iter(torch.rand(unseeded, generator=self._shared, dtype=torch.float64).tolist())
        u: list[float] = []
        for info in infos:
            seed = info.params.seed
            if seed is None:
                u.append(next(shared))
            else:
                self._seeded.manual_seed(seed_for_step(seed, len(info.output_ids)))
                u.append(torch.rand((), generator=self._seeded, dtype=torch.float64).item())
        return torch.tensor(u, dtype=torch.float64, device=device)

    def _sample_rows(
        self,
        x: torch.Tensor,
        x_block_max: torch.Tensor,
        rows: list[int],
        infos: Sequence[SampleInfo],
        bans: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """Sampled token for each of ``rows`` of the penalized logits ``x`` (``[B, width]``).

        ``exp`` is slow for arguments that underflow (and for ``-inf``), so they are clamped to
        ``_EXP_FLOOR`` first; banned ids and padding columns are then zeroed. Another ``-inf``
        logit keeps a weight of ``exp(_EXP_FLOOR)`` relative to the row's best token.
        """
        n, width, device = len(rows), x.shape[1], x.device
        num_blocks = width // BLOCK
        vocab = self.vocab_size
        params = [infos[r].params for r in rows]
        hyper = [[1.0 / p.temperature, _top_k(p, vocab), p.top_p, p.min_p] for p in params]
        inv_temp, top_k, top_p, min_p = (
            torch.tensor(hyper, dtype=torch.float32).to(device).unbind(1)
        )
        top_k = top_k.to(torch.int64)
        u = self._uniforms([infos[r] for r in rows], device)

        w = self._buffer("weights", n, width, device)
        if n == x.shape[0]:
            block_max = x_block_max.clone()
            row_max = block_max.amax(-1, keepdim=True)
            torch.sub(x, row_max, out=w)
        else:
            idx = _index(rows, device)
            block_max = x_block_max[idx]
            row_max = block_max.amax(-1, keepdim=True)
            torch.index_select(x, 0, idx, out=w)
            w.sub_(row_max)
        block_max.sub_(row_max)
        if any(p.temperature != 1.0 for p in params):
            w.mul_(inv_temp[:, None])
            block_max.mul_(inv_temp[:, None])
        w.clamp_(min=_EXP_FLOOR).exp_()
        block_max.clamp_(min=_EXP_FLOOR).exp_()
        if vocab < width:
            w[:, vocab:] = 0.0
        if bans is not None:
            ban_rows, ban_cols = bans
            if n < x.shape[0]:
                slot = torch.full((x.shape[0],), -1, dtype=torch.int64, device=device)
                slot[_index(rows, device)] = torch.arange(n, device=device)
                ban_rows = slot[ban_rows]
                ban_cols = ban_cols[ban_rows >= 0]
                ban_rows = ban_rows[ban_rows >= 0]
            w[ban_rows, ban_cols] = 0.0
        blocks = w.view(n, num_blocks, BLOCK)
        block_sum = blocks.sum(-1)

        tokens = torch.empty(n, dtype=torch.int64, device=device)
        filtered = [i for i, p in enumerate(params) if _filters(p, vocab)]
        plain = [i for i, p in enumerate(params) if not _filters(p, vocab)]
        if plain:
            idx = _index(plain, device)
            tokens[idx] = _draw(blocks, idx, None, block_sum[idx], None, u[idx])
        if not filtered:
            return tokens

        thr = min_p.clone()
        cut = [i for i in filtered if _top_k(params[i], vocab) or params[i].top_p < 1.0]
        if cut:
            c = _index(cut, device)
            found = cut_thresholds(w, c, block_max[c], top_k[c], top_p[c], block_sum[c].sum(-1))
            thr[c] = torch.maximum(thr[c], found)
        f = _index(filtered, device)
        kept = (block_max[f] >= thr[f, None] * _SLACK).sum(-1).tolist()
        groups: dict[int, list[tuple[int, int]]] = {}
        for i, count in zip(filtered, kept, strict=True):
            limit = next((g for g in _DRAW_GROUPS if count <= g < num_blocks), num_blocks)
            groups.setdefault(limit, []).append((i, count))
        for limit, members in groups.items():
            rg = _index([i for i, _ in members], device)
            sel = None if len(members) == n else rg
            group_thr = _pick(thr, sel)
            if limit < num_blocks:
                count = max(c for _, c in members)
                ids = _pick(block_max, sel).topk(count, -1).indices.sort(-1).values
                cand = blocks[rg[:, None], ids]
            else:
                ids, cand = None, blocks[rg]
            sums = cand.masked_fill_(cand < group_thr[:, None, None], 0.0).sum(-1)
            drawn = _draw(blocks, rg, ids, sums, group_thr, _pick(u, sel))
            if sel is None:
                return drawn
            tokens[rg] = drawn
        return tokens

    def _with_logprobs(
        self,
        x: torch.Tensor,
        x_block_max: torch.Tensor,
        infos: Sequence[SampleInfo],
        rows: list[int],
        next_ids: torch.Tensor,
    ) -> BatchOutput:
        n, width, device = len(rows), x.shape[1], x.device
        idx = _index(rows, device)
        row_max = x_block_max[idx].amax(-1)
        shifted = self._buffer("logprobs", n, width, device)
        torch.index_select(x, 0, idx, out=shifted)
        shifted.sub_(row_max[:, None]).clamp_(min=_EXP_FLOOR)
        lse = shifted.exp_().sum(-1).log_().add_(row_max)
        chosen = (x[idx, next_ids[idx]] - lse).tolist()
        top_n = max(infos[r].params.logprobs for r in rows)
        top_values: list[list[float]] = []
        top_ids: list[list[int]] = []
        if top_n > 0:
            values, ids = block_topk(x, top_n, idx, x_block_max[idx])
            top_values = (values - lse[:, None]).tolist()
            top_ids = ids.tolist()
        logprobs = [math.nan] * len(infos)
        top_logprobs: list[list[tuple[int, float]]] = [[] for _ in infos]
        for j, r in enumerate(rows):
            logprobs[r] = chosen[j]
            want = infos[r].params.logprobs
            if want:
                pairs = sorted(zip(top_ids[j], top_values[j], strict=True), key=_by_logprob)
                top_logprobs[r] = pairs[:want]
        return BatchOutput(
            next_token_ids=next_ids.tolist(), logprobs=logprobs, top_logprobs=top_logprobs
        )


def _params(infos: Sequence[SampleInfo]) -> list[SamplingParams]:
    return [info.params for info in infos]


def _top_k(p: SamplingParams, vocab: int) -> int:
    return p.top_k if 1 < p.top_k < vocab else 0


def _filters(p: SamplingParams, vocab: int) -> bool:
    return bool(_top_k(p, vocab)) or p.top_p < 1.0 or p.min_p > 0.0


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64, device=device)


def _by_logprob(pair: tuple[int, float]) -> tuple[float, int]:
    return -pair[1], pair[0]


def _gather_blocks(blocks: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``blocks[r, ids[r, j], :]`` as ``[n, len(ids[r]), BLOCK]``."""
    return blocks.gather(1, ids.unsqueeze(-1).expand(-1, -1, blocks.shape[-1]))


def sorted_prefix(x: torch.Tensor, length: int) -> torch.Tensor:
    """The ``length`` largest values of each row of 2-D ``x``, descending.

    On CPU via numpy's SIMD partition and sort: ``torch.sort`` / ``torch.topk`` cost
    milliseconds per 50k-wide row there.
    """
    width = x.shape[1]
    length = min(length, width)
    if x.device.type != "cpu":
        return x.topk(length, -1).values
    a = x.detach().numpy()
    if 2 * length < width:
        a = np.partition(a, width - length, axis=-1)[:, width - length :]
    else:
        a = a.copy()
    a.sort(axis=-1)
    return torch.from_numpy(a).flip(-1)


def cut_thresholds(
    w: torch.Tensor,
    rows: torch.Tensor,
    block_max: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    totals: torch.Tensor,
) -> torch.Tensor:
    """Smallest kept weight under top-k then top-p for rows ``rows`` of ``w`` (0: keep all).

    ``w``: ``[B, width]`` weights; ``block_max`` (``[len(rows), width // BLOCK]``, up to a few
    ulps), ``top_k`` (0: off), ``top_p``, ``totals`` (row sums): one row per entry of ``rows``.
    First ranks only the values in the ``J`` blocks with the largest maxima: each such value
    above the next block maximum (``bound``) is one of the row's true largest values, so a cut
    found among those is exact. Rows whose cut lies deeper retry with a sorted prefix of the
    whole row, then with all of it.
    """
    width = w.shape[1]
    num_blocks = width // BLOCK
    device = w.device
    n = rows.numel()
    k_list = top_k.tolist()
    thr = torch.zeros(n, dtype=w.dtype, device=device)
    pending = list(range(n))
    for level in ("blocks", *_CUT_PREFIXES, "all"):
        sel = None if len(pending) == n else _index(pending, device)
        r = _pick(rows, sel)
        k_max = max(k_list[i] for i in pending)
        final = level == "all"
        if level == "blocks":
            num_cand = max(_CUT_BLOCKS, k_max)
            if 4 * num_cand > num_blocks:
                continue
            top = _pick(block_max, sel).topk(num_cand + 1, -1)
            bound = top.values[:, -1] / _SLACK
            cand = w.view(-1, num_blocks, BLOCK)[r[:, None], top.indices[:, :-1]]
            values = sorted_prefix(cand.view(len(pending), -1), 4 * num_cand)
        else:
            length = width if final else max(int(level), k_max)
            if not final and 4 * length > width:
                continue
            values = sorted_prefix(w if len(pending) == w.shape[0] else w[r], length)
            bound = torch.full((len(pending),), -1.0, dtype=w.dtype, device=device)
        ok, cut = _cut_from_sorted(
            values.to(device),
            bound,
            _pick(top_k, sel),
            _pick(top_p, sel),
            _pick(totals, sel),
            final,
        )
        ok_list = ok.tolist()
        if sel is None and all(ok_list):
            return cut
        resolved = [i for i, good in zip(pending, ok_list, strict=True) if good]
        if resolved:
            thr[_index(resolved, device)] = cut[ok]
        pending = [i for i, good in zip(pending, ok_list, strict=True) if not good]
        if not pending:
            break
    return thr


def _pick(t: torch.Tensor, sel: torch.Tensor | None) -> torch.Tensor:
    return t if sel is None else t[sel]


def _cut_from_sorted(
    values: torch.Tensor,
    bound: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    totals: torch.Tensor,
    final: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(found, threshold) per row from its largest weights ``values`` sorted descending.

    Entries greater than ``bound`` are known to be the row's true largest values. top_k
    (0: off) keeps weights >= the k-th largest. top_p then works on the distribution
    renormalized over that set (over the whole row, mass ``totals``, without top_k): it keeps
    the largest weights up to and including the first whose cumulative mass reaches
    ``top_p * mass``. Ties with a cut value are kept. On the ``final`` full sort, a top_p cut
    that rounding keeps out of reach keeps every token.
    """
    length = values.shape[1]
    pos = torch.arange(length, device=values.device)
    exact = (values > bound[:, None]).sum(-1)
    has_k = top_k > 0
    k_idx = (top_k - 1).clamp(0, length - 1)[:, None]
    kth = torch.where(has_k, values.gather(1, k_idx).squeeze(1), 0.0)
    ok = ~has_k | (top_k <= exact)
    in_k = ~has_k[:, None] | (pos < top_k[:, None])
    cum = (values * in_k).cumsum(-1)
    mass = torch.where(has_k, cum.gather(1, k_idx).squeeze(1), totals)
    reach = (cum >= (top_p * mass)[:, None]) & (pos < exact[:, None])
    has_p = top_p < 1.0
    found = reach.any(-1)
    first = reach.to(torch.uint8).argmax(-1, keepdim=True)
    cut_p = torch.where(has_p & found, values.gather(1, first).squeeze(1), 0.0)
    if not final:
        ok = ok & (~has_p | found)
    return ok, torch.maximum(kth, cut_p)


def _draw(
    blocks: torch.Tensor,
    rows: torch.Tensor,
    block_ids: torch.Tensor | None,
    sums: torch.Tensor,
    thr: torch.Tensor | None,
    u: torch.Tensor,
) -> torch.Tensor:
    """Token per row of ``rows`` drawn with probability proportional to its weight.

    ``blocks``: ``[B, num_blocks, BLOCK]`` non-negative weights; weights below ``thr`` count as
    zero. ``sums``: mass of each row's blocks ``block_ids`` (ascending; None: all blocks).
    ``u``: float64 uniforms in [0, 1). Inverse CDF in token-id order, over block masses then
    inside the chosen block; a search only lands where the cumulative sum grows, so a
    zero-weight token is never chosen.
    """
    sums = sums.double()
    cum = sums.cumsum(-1)
    total = cum[:, -1:]
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    b = torch.searchsorted(cum, target, right=True)
    before = torch.where(b > 0, cum.gather(1, (b - 1).clamp_min(0)), 0.0)
    frac = ((target - before) / sums.gather(1, b)).clamp(0.0, 1.0)
    block = (b if block_ids is None else block_ids.gather(1, b)).squeeze(1)
    inner = blocks[rows, block]
    if thr is not None:
        inner = inner.masked_fill(inner < thr[:, None], 0.0)
    inner = inner.double().cumsum(-1)
    last = inner[:, -1:]
    limit = torch.nextafter(last, torch.zeros_like(last))
    off = torch.searchsorted(inner, torch.minimum(frac * last, limit), right=True)
    return block * BLOCK + off.squeeze(1)
