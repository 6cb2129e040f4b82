"""Drafter losses as pure functions of tensors.

Knows nothing about models, positions or label shifting: callers align `draft_logits[:, t]`
with the target row that is its label (see `drafters.layers.ttt_label_rows`) before calling.
Metrics stay tensors (no host sync); call `.item()` at log steps only.
"""

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from drafters.draft_vocab import draft_rank, kept_target_ids


class LabelLogits:  # not drafters.heads.HeadRows (which rows train which Medusa head)
    """The target's logits at chosen rows only, computed on demand: the label side of a loss without the
    (B, T, V) tensor (V = 49k for SmolLM2, 262k for Gemma-3) that a full LM head pass materialises.
        hidden (B, T, h): the final-normed last hidden state (HF hidden_states index L)
        head: (N, h) -> (N, V), the target's frozen head (lm_head, then its logit softcap if any)
    rows[index] = head(hidden[index]) = full_logits[index] for an index into (B, T) that selects rows: a (B, T)
    bool mask -> (N, V), or a pair of (N,) batch and position index tensors -> (N, V), as a tensor would be
    indexed; shape = (B, T, V). Code written for a (B, T, V) logits tensor that only reads it at chosen rows takes
    either. Online and offline training build it the same way, so their labels are computed identically."""

    def __init__(self, hidden: Tensor, head):
        self.hidden, self.head = hidden, head

    def __getitem__(self, index) -> Tensor:
        return self.head(self.hidden[index])

    @property
    def shape(self) -> tuple[int, int, int]:
        return (*self.hidden.shape[:2], self.head.out_features)


class NextTokenHead:
    """The label side of a pass over raw text (features.source: text), as a LabelLogits head: each row's "hidden"
    is the data's next token id, and the logits are those of a target certain of it. ids (N, 1) long -> (N, V)
    float32, 0 everywhere but ONE_HOT_LOGIT at the id: softmax gives exactly the one-hot (exp(-1e4) underflows to 0
    in float32) and argmax the id, so every loss over target logits becomes cross-entropy on the data's next token,
    and a row whose next token is outside the draft vocabulary is never scored, as a target argmax there is not."""

    ONE_HOT_LOGIT = 1.0e4

    def __init__(self, vocab_size: int):
        self.out_features = vocab_size  # V, as FrozenHead names it

    def __call__(self, ids: Tensor) -> Tensor:
        logits = torch.zeros(len(ids), self.out_features, device=ids.device)
        return logits.scatter_(1, ids.long().reshape(-1, 1), self.ONE_HOT_LOGIT)


LABEL_CHUNK_ELEMENTS = 2**24  # target logits held at once: (rows, V) with rows * V <= 2^24, 64 MB in float32
LABEL_CHUNK_ROWS: int | None = None  # a fixed row count instead (tests); None: LABEL_CHUNK_ELEMENTS // V


def label_chunks(target_logits, mask: Tensor, rows: int | None = None):
    """target_logits[mask] (N, V) as consecutive (<= rows, V) pieces, so the label side never holds the target's
    logits at all N rows at once: a LabelLogits computes each piece from its hidden rows (the head applied per
    piece), a logits tensor is sliced. Every row's values are those of the whole (N, V) tensor. The piece is
    LABEL_CHUNK_ELEMENTS large whatever V: 128 rows at V = 128k, 512 at 32k."""
    if isinstance(target_logits, LabelLogits):
        hidden = target_logits.hidden[mask]  # (N, h)
        rows = rows or LABEL_CHUNK_ROWS or max(1, LABEL_CHUNK_ELEMENTS // target_logits.head.out_features)
        for start in range(0, max(len(hidden), 1), rows):
            yield target_logits.head(hidden[start:start + rows])
    else:
        selected = target_logits[mask]  # (N, V)
        rows = rows or LABEL_CHUNK_ROWS or max(1, LABEL_CHUNK_ELEMENTS // target_logits.shape[-1])
        for start in range(0, max(len(selected), 1), rows):
            yield selected[start:start + rows]


def in_row_chunks(fn, num_rows: int, width: int, rows: int | None = None) -> tuple[Tensor, ...]:
    """sum over consecutive row chunks `part` of fn(part) -> a tuple of 0-dim tensors (a loss sum, counts), for a
    loss that projects rows onto a (c, width) vocabulary (Medusa's and Blockwise's heads, EAGLE-1's frozen head:
    no fused head of their own). The chunks hold LABEL_CHUNK_ELEMENTS logits whatever the width (rows: a fixed
    count instead); under autograd each runs under activation checkpointing, so its (c, width) logits,
    log-probabilities and labels are recomputed in backward, not kept: what the loss holds for backward is the
    (M, d) rows, never (M, width). One chunk (or no grad): fn(all rows) as it is, nothing recomputed."""
    rows = rows or LOGIT_CHUNK_ROWS or max(1, LABEL_CHUNK_ELEMENTS // width)
    if num_rows <= rows:
        return fn(slice(0, num_rows))
    total = None
    for start in range(0, num_rows, rows):
        part = slice(start, start + rows)
        out = checkpoint(fn, part, use_reentrant=False) if torch.is_grad_enabled() else fn(part)
        total = out if total is None else tuple(a + b for a, b in zip(total, out))
    return total


LOGIT_CHUNK_ROWS: int | None = None  # in_row_chunks' rows per chunk (tests); None: LABEL_CHUNK_ELEMENTS // width


@torch.no_grad()
def draft_vocab_targets(target_logits: Tensor, t2d: Tensor, draft_vocab_size: int):
    """target_logits (B, T, V) (or any leading shape, e.g. (N, V) gathered rows) -> what the
    EAGLE-3 loss needs from the target, per position:
        target_p (B, T, Vd) float32 = softmax(target_logits[..., used])  renormalised over the vocab
        in_vocab (B, T) bool        = t2d[argmax_V target_logits]        FULL-vocab argmax is kept
        argmax_draft (B, T) long    = draft id of that argmax (meaningful where in_vocab)"""
    target_argmax = target_logits.argmax(-1)  # (B, T) over the full target vocab
    target_p = draft_vocab_softmax(target_logits, kept_target_ids(t2d, draft_vocab_size))
    return target_p, t2d[target_argmax], draft_rank(t2d)[target_argmax]


def draft_vocab_softmax(target_logits: Tensor, used: Tensor) -> Tensor:
    """target_p: the softmax of the target's logits (..., V) over the draft vocabulary's columns `used` (Vd,)
    (kept_target_ids), renormalised there -> (..., Vd) float32."""
    return torch.softmax(target_logits.index_select(-1, used).float(), dim=-1)


DIVERGENCES = ("kl", "reverse_kl", "jsd", "lk", "argmax")  # the `divergence` a drafter trains with
TINY = 1e-30  # floor of p inside log p (reverse_kl) and of A inside -log A (lk): p underflows to 0 in float32


def divergence_rows(log_q: Tensor, p: Tensor, divergence: str = "kl") -> Tensor:
    """Each row's training loss between the target's distribution p and the draft's q = exp(log_q), both (..., Vd)
    over the draft vocabulary, as differentiable torch ops (autograd is the reference the fused gradients of
    `divergence_grad` are tested against). With A = sum_d min(p_d, q_d), the probability that a token drafted from
    q is accepted when the target samples from p (A = 1 - TV(p, q)):
        kl          -sum_d p_d log q_d                     (soft cross-entropy: KL(p || q) + H(p); EAGLE's loss)
        reverse_kl  sum_d q_d (log q_d - log p_d)          KL(q || p), mode-seeking
        jsd         1/2 KL(p || m) + 1/2 KL(q || m),  m = (p + q) / 2
        lk          -log A                                 the LK loss (arXiv 2602.23881): acceptance itself
        argmax      -log q_a,  a = argmax_d p_d            hard labels: greedy acceptance is [argmax q = a]
    -> (...,) float32."""
    log_q = log_q.float()
    if divergence == "kl":
        return -(p * log_q).sum(-1)
    if divergence == "argmax":
        return -log_q.gather(-1, p.argmax(-1, keepdim=True)).squeeze(-1)
    q = log_q.exp()
    if divergence == "reverse_kl":
        return (q * (log_q - p.clamp_min(TINY).log())).sum(-1)
    if divergence == "jsd":
        log_m = ((p + q) / 2).log()
        return 0.5 * (torch.xlogy(p, p) - p * log_m).sum(-1) + 0.5 * (q * (log_q - log_m)).sum(-1)
    if divergence == "lk":
        return -torch.minimum(p, q).sum(-1).clamp_min(TINY).log()
    raise ValueError(f"divergence={divergence!r}: use one of {', '.join(DIVERGENCES)}")


@torch.no_grad()
def divergence_grad(log_q: Tensor, p: Tensor, divergence: str = "kl") -> tuple[Tensor, Tensor, Tensor]:
    """`divergence_rows` and its gradient with respect to the logits z (q = softmax(z)), by hand, for the fused head:
        kl          dL/dz = q - p
        argmax      dL/dz = q - onehot(a)
        otherwise   dL/dz = q * (g - <q, g>),  g = dL/dq (the softmax Jacobian d q_d / d z_j = q_d (delta_dj - q_j)):
            reverse_kl  g = log q - log p (+1, which <q, g> cancels)
            jsd         g = 1/2 log(q / m)
            lk          g = -[q < p] / A
    log_q, p (c, Vd) -> (loss (c,), dL/dz (c, Vd), q (c, Vd)), float32 (q returned for a caller's further terms).
    kl and argmax need no log q after the loss: q is then log_q exponentiated in place (one (c, Vd) less per chunk,
    as the fused head held before), so the caller must not read log_q again."""
    loss = divergence_rows(log_q, p, divergence)
    q = log_q.float().exp_() if divergence in ("kl", "argmax") else log_q.float().exp()
    if divergence == "kl":
        return loss, q - p, q
    if divergence == "argmax":
        return loss, q - torch.zeros_like(q).scatter_(-1, p.argmax(-1, keepdim=True), 1.0), q
    if divergence == "reverse_kl":
        g = log_q.float() - p.clamp_min(TINY).log()
    elif divergence == "jsd":
        g = 0.5 * (log_q.float() - ((p + q) / 2).log())
    else:  # lk
        g = -(q < p).float() / torch.minimum(p, q).sum(-1, keepdim=True).clamp_min(TINY)
    return loss, q * (g - (q * g).sum(-1, keepdim=True)), q


def soft_cross_entropy(draft_logits: Tensor, target_p: Tensor, in_vocab: Tensor,
                       argmax_draft: Tensor, loss_mask: Tensor, *,
                       num_positions: int | Tensor | None = None, tv_weight: float = 0.0, divergence: str = "kl"
                       ) -> tuple[Tensor, Tensor, Tensor]:
    """draft_logits (B, T, Vd); the other inputs from `draft_vocab_targets`; loss_mask (B, T) 0/1.
    Any leading shape works, e.g. (M, Vd) rows gathered at the counted positions only (with an
    all-ones mask): the sums, hence loss, accuracy and gradients, are the same.
        counted_t = loss_mask_t and in_vocab_t,   q_t = softmax(draft_logits_t)
        row_t = D(target_p_t, q_t)  +  tv_weight * 1/2 sum_d |q_td - target_p_td|
                (D = `divergence_rows`; the default kl: -sum_d target_p_td log q_td)
        loss = sum_t counted_t * row_t / num_positions
               (num_positions defaults to count = sum_t counted_t: the mean over counted positions)
        accuracy = mean over counted t of [argmax draft_logits_t == argmax_draft_t]
    The second term is the total variation distance TV(p, q) = 1 - sum_d min(p_d, q_d), one minus the
    probability that a token drafted from q is accepted when the target samples from p (tv_weight 0:
    D alone). Returns (loss, accuracy, count), 0-dim tensors; loss and accuracy
    are 0 when count is 0."""
    counted = loss_mask.bool() & in_vocab  # (B, T)
    log_q = torch.log_softmax(draft_logits.float(), dim=-1)  # (B, T, Vd)
    ce = divergence_rows(log_q, target_p, divergence)  # (B, T)
    if tv_weight:
        ce = ce + tv_weight * 0.5 * (log_q.exp() - target_p).abs().sum(-1)
    count = counted.sum()
    denominator = count.clamp(min=1) if num_positions is None else num_positions
    loss = torch.where(counted, ce, 0.0).sum() / denominator
    with torch.no_grad():
        correct = (draft_logits.argmax(-1) == argmax_draft) & counted
        accuracy = correct.sum() / count.clamp(min=1)
    return loss, accuracy, count


def soft_cross_entropy_draft_vocab(draft_logits: Tensor, target_logits: Tensor, t2d: Tensor,
                                   loss_mask: Tensor, *, num_positions: int | Tensor | None = None
                                   ) -> tuple[Tensor, Tensor, Tensor]:
    """EAGLE-3 token loss against the target distribution renormalised over the draft vocab.

    draft_logits (B, T, Vd), target_logits (B, T, V) = the label rows, t2d (V,) bool,
    loss_mask (B, T). Positions whose full-vocab target argmax is outside the draft vocab are
    masked; accuracy compares the draft argmax, mapped to a target id, with the target argmax.
    -> (loss, accuracy, count) as in `soft_cross_entropy`."""
    targets = draft_vocab_targets(target_logits, t2d, draft_logits.shape[-1])
    return soft_cross_entropy(draft_logits, *targets, loss_mask, num_positions=num_positions)


class LinearSoftCrossEntropy(torch.autograd.Function):
    """The loss of `soft_cross_entropy` (D = `divergence_rows`, plus tv_weight x total variation) of the logits
    z = x W^T, fused with the LM head, `chunk` rows at a time, so no (M, Vd) logits, log-probabilities or softmax
    are kept for backward (seven TTT steps of them are most of EAGLE-3's training memory). Per row m, with
    q = softmax(z_m), sum_d p_md = 1 (target_p is a distribution over the draft vocabulary), lam = tv_weight and
    g = 1/2 sign(q_m - p_m):
        loss     = scale * sum_m [D(p_m, q_m) + lam/2 sum_d |q_md - p_md|]
        dL/dz_m  = scale * (dD/dz_m + lam q_m * (g - <q_m, g>))    (c, Vd) per chunk, then dropped
                   (dD/dz_m from `divergence_grad`, q_m - p_m for kl; the softmax Jacobian is
                   d q_d / d z_j = q_d (delta_dj - q_j))
        dL/dx_m  = dL/dz_m W           dL/dW = sum_m dL/dz_m^T x_m    (M, h) and (Vd, h)
    Two schedules of the same arithmetic (recompute):
        False  the gradients are computed in the forward pass and kept until backward: one matmul pass, but each
               call holds a (Vd, h) float32 dL/dW (k of them over k TTT steps)
        True   forward computes the loss alone and keeps x; backward recomputes z, p and dL/dz chunk by chunk:
               one more pass of z (and of the labels, when target_p is a RecomputedLabels), nothing kept that
               grows with Vd
    backward scales the gradients by the incoming scalar gradient; both schedules give the same numbers. Matmuls run
    in x's dtype (bf16 under autocast), the softmax and the accumulated dL/dW in float32, as the unfused path does."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, target_p, scale: float, chunk: int, tv_weight: float,
                divergence: str, target_rows: Tensor | None = None, recompute: bool = False):
        # target_rows (M,): row m's labels are target_p[target_rows[m]] (a step's rows of the whole label table,
        # gathered a chunk at a time: no (M, Vd) copy of it per step); None: target_p is (M, Vd) itself.
        # target_p is a tensor or a RecomputedLabels (rows of it computed when read)
        train_w = ctx.needs_input_grad[1]  # a frozen head (DFlash: the target's rows) needs no dL/dW
        ctx.setup = (scale, chunk, tv_weight, divergence, train_w, weight.dtype)
        loss, argmax = x.new_zeros((), dtype=torch.float32), torch.empty(len(x), dtype=torch.long, device=x.device)
        grads = fused_chunks(ctx, x, weight, target_p, target_rows, loss, argmax, grads=not recompute)
        if recompute:
            ctx.labels = (target_p, target_rows)
            ctx.save_for_backward(x, weight)
        else:
            ctx.save_for_backward(*grads)
        ctx.recompute = recompute
        ctx.mark_non_differentiable(argmax)
        return loss * scale, argmax

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_argmax):
        if ctx.recompute:
            x, weight = ctx.saved_tensors
            grad_x, grad_w = fused_chunks(ctx, x, weight, *ctx.labels)
        else:
            grad_x, grad_w = ctx.saved_tensors
        train_w, weight_dtype = ctx.setup[4:]
        if train_w:  # a recomputed dL/dW is this call's own: scaled in place, no second (Vd, h) float32 copy
            grad_w = (grad_w.mul_(grad_loss) if ctx.recompute else grad_w * grad_loss).to(weight_dtype)
        else:
            grad_w = None
        return grad_x * grad_loss.to(grad_x.dtype), grad_w, None, None, None, None, None, None, None


def chunk_slices(rows: int, chunk: int):
    return (slice(start, start + chunk) for start in range(0, rows, chunk))


def chunk_labels(target_p, target_rows: Tensor | None, rows: slice) -> Tensor:
    """The (c, Vd) labels of the chunk `rows` of the fused loss's x."""
    return target_p[rows] if target_rows is None else target_p[target_rows[rows]]


@torch.no_grad()
def fused_chunks(ctx, x: Tensor, weight: Tensor, target_p, target_rows: Tensor | None,
                 loss: Tensor | None = None, argmax: Tensor | None = None, grads: bool = True
                 ) -> tuple[Tensor, Tensor] | None:
    """LinearSoftCrossEntropy's chunk loop: dL/dx (M, h) and dL/dW (Vd, h) float32 (empty for a frozen head), each
    scaled by ctx.setup's scale; adds each chunk's loss into `loss` and writes its argmax where given.
    grads=False: the loss and argmax alone (the recompute schedule's forward) -> None."""
    scale, chunk, tv_weight, divergence, train_w, _ = ctx.setup
    w = weight.to(x.dtype)
    if grads:
        grad_x = torch.empty_like(x)
        grad_w = torch.zeros(weight.shape if train_w else (0,), dtype=torch.float32, device=x.device)
    for rows in chunk_slices(len(x), chunk):
        p = chunk_labels(target_p, target_rows, rows)  # (c, Vd)
        z = (x[rows] @ w.T).float()  # (c, Vd)
        if argmax is not None:
            argmax[rows] = z.argmax(-1)
        log_q = torch.log_softmax(z, dim=-1)
        if not grads:  # the same sum as below, in the same order of additions: equal bit for bit
            loss += divergence_rows(log_q, p, divergence).sum()
            if tv_weight:
                loss += tv_weight * 0.5 * (log_q.exp() - p).abs().sum()
            continue
        row_loss, dz, q = divergence_grad(log_q, p, divergence)  # (c,), (c, Vd), (c, Vd)
        if loss is not None:
            loss += row_loss.sum()
        if tv_weight:
            difference = q - p
            if loss is not None:
                loss += tv_weight * 0.5 * difference.abs().sum()
            g = 0.5 * difference.sign()
            dz += tv_weight * q * (g - (q * g).sum(-1, keepdim=True))
        dz = dz.mul_(scale).to(x.dtype)
        grad_x[rows] = dz @ w
        if train_w:
            grad_w += (dz.T @ x[rows]).float()
    return (grad_x, grad_w) if grads else None


def dpace_weights(confidence: Tensor, counted: Tensor, alpha: float) -> Tensor:
    """D-PACE's weights (arXiv 2605.18810) along the last dimension, a chain of drafts j = 1..J, detached: DFlash's
    block slots ((B, N, Bk-1): confidence = the draft's probability of the target's argmax at slot j, q_j) and
    EAGLE-3's TTT steps ((K,): each step's accuracy on the batch). counted: the same shape, bool. With
    s_j = (1 - alpha) q_j + alpha at counted slots and 1 elsewhere, P_j = prod_{i <= j} s_i (a smooth probability
    that slots 1..j are all accepted) and tau ~ sum_j counted_j P_j (the chain's expected accepted length), the
    weight of slot j's cross-entropy is
        w_j = sum_{m >= j} counted_m P_m = d tau / d log s_j,
    what raising slot j's log-probability is worth to the accepted length: the first slots weigh most while they
    end most prefixes, and the weight moves to later slots as the first ones become reliable."""
    smooth = torch.where(counted, (1 - alpha) * confidence.float() + alpha, 1.0)
    prefix = torch.cumprod(smooth, dim=-1)  # (..., J) P_j
    return (prefix * counted).flip(-1).cumsum(-1).flip(-1)  # (..., J) w_j = sum_{m >= j} counted_m P_m


LOSS_CHUNK_ELEMENTS = 2**23  # (c, Vd) float32 logits of one fused-loss chunk: 32 MB, whatever Vd
LOSS_CHUNK_MAX_ROWS = 256  # and no more rows than this (the chunk's matmuls are large enough by then)


def loss_chunk_rows(vocab: int) -> int:
    """Rows of one fused-loss chunk over a Vd-wide head: LOSS_CHUNK_ELEMENTS logits (each of the chunk's
    (c, Vd) float32 transients is 32 MB: logits, log q, q, dL/dz, labels), at most LOSS_CHUNK_MAX_ROWS; 256 rows at
    Vd = 32k, 65 at 128k, 32 at 256k."""
    return max(1, min(LOSS_CHUNK_MAX_ROWS, LOSS_CHUNK_ELEMENTS // max(vocab, 1)))


def linear_soft_cross_entropy(x: Tensor, weight: Tensor, target_p: Tensor, argmax_draft: Tensor, *,
                              num_positions: int | None = None, chunk: int | None = None, tv_weight: float = 0.0,
                              divergence: str = "kl", target_rows: Tensor | None = None, recompute: bool = False
                              ) -> tuple[Tensor, Tensor, Tensor]:
    """`soft_cross_entropy(x @ weight.T, target_p, ...)` over rows that all count, without the logits tensor.
    x (M, h) the normed hidden states, weight (Vd, h) the drafter's LM head, target_p (M, Vd), argmax_draft
    (M,); or target_p (N, Vd) the whole label table (or a RecomputedLabels) and target_rows (M,) the rows of it
    that x's rows are scored against (read a chunk at a time). recompute: the gradients in backward
    (LinearSoftCrossEntropy). chunk: rows per chunk, default `loss_chunk_rows(Vd)`. -> (loss, accuracy, count) as
    `soft_cross_entropy` returns them (loss = sum / num_positions, default the mean over the M rows)."""
    count = torch.tensor(len(x), device=x.device)
    chunk = chunk or loss_chunk_rows(weight.shape[0])
    scale = 1.0 / (num_positions if num_positions is not None else max(len(x), 1))
    if torch.is_autocast_enabled(x.device.type):  # the matmul dtype an autocast nn.Linear would use
        x = x.to(torch.get_autocast_dtype(x.device.type))
    # without autograd (held-out evaluation) no gradient is ever read: the recompute schedule's forward is the loss
    # alone, a third of the kept schedule's matmuls
    recompute = recompute or not torch.is_grad_enabled()
    loss, argmax = LinearSoftCrossEntropy.apply(x, weight, target_p, scale, chunk, tv_weight, divergence,
                                                target_rows, recompute)
    accuracy = (argmax == argmax_draft).sum() / count.clamp(min=1)
    return loss, accuracy, count


class FusedLinearHead(nn.Linear):
    """A bias-free LM head, nn.Linear when called with x alone; called with the targets it returns
    `linear_soft_cross_entropy(x, self.weight, ...)` instead of logits. The fused loss reaches the weight through
    this module's call, never by reading `.weight` from outside: engines that shard parameters (DeepSpeed ZeRO-3,
    FSDP) gather a module's own parameters around its forward and its backward, and a weight read outside them
    is an empty shard. Same parameter name and shape as nn.Linear: checkpoints and exports are unchanged."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: Tensor, target_p: Tensor | None = None, argmax_draft: Tensor | None = None, *,
                num_positions: int | None = None, tv_weight: float = 0.0, divergence: str = "kl",
                target_rows: Tensor | None = None, recompute: bool = False):
        if target_p is None:
            return super().forward(x)
        return linear_soft_cross_entropy(x, self.weight, target_p, argmax_draft, num_positions=num_positions,
                                         tv_weight=tv_weight, divergence=divergence, target_rows=target_rows,
                                         recompute=recompute)


class RecomputedLabels:
    """The label table of `chunked_draft_vocab_targets` without the table: row n of it, target_p[n] (Vd,), is
    computed each time it is read, from the target's final hidden state at the n-th needed position (the frozen
    head applied to those rows only, then `draft_vocab_targets`). Indexed like the table, by a (c,) row index ->
    (c, Vd) float32; what it keeps is (N, h), not (N, Vd). The fused loss reads each row twice per TTT step
    (forward and backward): the label head's matmul is paid 2k times instead of once, for memory flat in Vd."""

    def __init__(self, hidden: Tensor, head, t2d: Tensor, draft_vocab_size: int):
        self.hidden, self.head = hidden, head
        self.used = kept_target_ids(t2d, draft_vocab_size)  # (Vd,) the target ids of the draft vocabulary

    @torch.no_grad()
    def __getitem__(self, rows: Tensor) -> Tensor:
        return draft_vocab_softmax(self.head(self.hidden[rows]), self.used)  # draft_vocab_targets' target_p

    def __len__(self) -> int:
        return len(self.hidden)


def chunked_draft_vocab_targets(drafter, target_logits, needed: Tensor, *, recompute: bool = False
                                ) -> tuple[Tensor | RecomputedLabels, Tensor, Tensor]:
    """`draft_vocab_targets` at the rows where `needed` (B, T) bool, computed a label chunk at a time
    (label_chunks) into tables allocated once: the target's logits are never held at all N rows at once, and the
    (N, Vd) labels exist once (no list of pieces concatenated, no copy of the in-vocabulary rows).
    recompute (target_logits a LabelLogits): target_p is a RecomputedLabels over the N needed hidden rows instead
    of the (N, Vd) table; in_vocab and argmax_draft are computed as before.
    -> target_p (N, Vd) float32, in_vocab (N,) bool, argmax_draft (N,) long, in the order of needed's True rows."""
    n, device, vd = int(needed.sum()), needed.device, drafter.config.draft_vocab_size
    recompute = recompute and isinstance(target_logits, LabelLogits)  # a logits tensor is already (B, T, V)
    target_p = None if recompute else torch.empty(n, vd, dtype=torch.float32, device=device)
    in_vocab = torch.empty(n, dtype=torch.bool, device=device)
    argmax_draft = torch.empty(n, dtype=torch.long, device=device)
    start, rank = 0, draft_rank(drafter.t2d) if recompute else None
    for logits in label_chunks(target_logits, needed):
        end = start + len(logits)
        if recompute:  # the argmax alone: what draft_vocab_targets reads of the full-vocab logits besides p
            argmax = logits.argmax(-1)
            in_vocab[start:end], argmax_draft[start:end] = drafter.t2d[argmax], rank[argmax]
        else:
            target_p[start:end], in_vocab[start:end], argmax_draft[start:end] = draft_vocab_targets(
                logits, drafter.t2d, vd)
        start = end
    if recompute:
        target_p = RecomputedLabels(target_logits.hidden[needed], target_logits.head, drafter.t2d, vd)
    return target_p, in_vocab, argmax_draft


def table_rows(needed: Tensor, in_vocab: Tensor) -> Tensor:
    """needed (B, T) bool, in_vocab (N,) over needed's True positions -> (B, T) long: each position's row in the
    label tables (chunked_draft_vocab_targets), -1 where it is not needed or its target argmax is outside the draft
    vocabulary (never scored)."""
    rows = torch.full(needed.shape, -1, dtype=torch.long, device=needed.device)
    rows[needed] = torch.where(in_vocab, torch.arange(len(in_vocab), device=needed.device), -1)
    return rows


def supervised_targets(drafter, target_logits, loss_mask: Tensor, *, recompute: bool = False
                       ) -> tuple[Tensor, tuple[Tensor | RecomputedLabels, Tensor]]:
    """The target side of the EAGLE-3 / P-EAGLE loss, at the rows some TTT step (or P-EAGLE slot) scores: row r
    (label of step i at t = r-1-i) is scored iff loss_mask[r+1] = 1 and its full-vocab target argmax is in the draft
    vocab (`draft_vocab_targets`). target_logits (B, T, V), loss_mask (B, T) ->
        rows (B, T) long: index of row r into the two tensors below, -1 where never scored
        target_p (N, Vd) float32, argmax_draft (N,) long: `draft_vocab_targets` at the needed rows (those whose
        target argmax is outside the draft vocabulary are in the tables but no position points at them);
        recompute: target_p a RecomputedLabels (chunked_draft_vocab_targets)"""
    needed = torch.cat([loss_mask[:, 1:], torch.zeros_like(loss_mask[:, :1])], 1).bool()  # (B, T): loss_mask[r+1]
    target_p, in_vocab, argmax_draft = chunked_draft_vocab_targets(drafter, target_logits, needed,
                                                                   recompute=recompute)
    return table_rows(needed, in_vocab), (target_p, argmax_draft)
