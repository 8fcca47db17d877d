"""Transformer blocks as ODE steps, and a small vision transformer trained layer-parallel.

A pre-norm transformer block updates the token states ``u`` (shape
``(batch, tokens, dim)``) by

    a = Attn(LN1(u));  u <- u + a;  u <- u + MLP(LN2(u))

which is one step ``u <- u + h F(u)`` with ``h = 1`` and the right-hand side

    F(u) = phi1(u) + phi2(u + phi1(u)),   phi1 = Attn o LN1,  phi2 = MLP o LN2

(:class:`TransformerBlock`, ``form="sequential"``). With ``h = T / N < 1`` the
same layers are forward Euler on the ODE ``u' = F(u)``, which is what
:class:`~propagators.torch.LayerParallel` solves with MGRIT. Other
arrangements are here too: ``form="parallel"`` (``F = phi1(u) + phi2(u)``,
both sublayers read the same state) and the two half-steps as separate layers
(:class:`AttentionLayer`, :class:`MLPLayer` alternating; :func:`transformer_layers`
with ``form="halves"``). docs/transformer.md compares them; in short, one
layer per block keeps attention and MLP together in every coarse step, while
alternating half-step layers lose the MLP on coarse levels with an even
coarsening factor (parameter injection picks the first layer of each coarse
interval, always an attention layer).

Every layer is written with plain tensor operations (matrix products,
softmax, LayerNorm) and works with ``torch.func.functional_call`` and
``torch.func.vmap``, so a class of blocks is evaluated batched over the
intervals of an MGRIT sweep (:mod:`propagators.torch.kernel`).

:func:`make_vit` builds the vision transformer of the digits demos:
patch embedding -> ``LayerParallel`` blocks (wrapped in
:class:`~propagators.torch.switch.Switchable`, so that training can move to
serial gradients, docs/transformer.md) -> LayerNorm -> pooling -> linear head.
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from mgrit.hierarchy import check_flag, check_integer, check_real, is_integer

from .module import LayerParallel, ODENet, _copied
from .switch import SerialSwitch, Switchable

__all__ = ["AttentionLayer", "MLPLayer", "TransformerBlock", "transformer_layers", "PatchEmbedding",
           "ClassifierHead", "ViT", "make_vit", "Switchable", "SerialSwitch", "with_key_padding",
           "without_key_padding"]

FORMS = ("sequential", "parallel", "halves")


def _check_dims(dim: int, heads: int) -> None:
    if not (is_integer(dim) and is_integer(heads)) or dim < 1 or heads < 1 or dim % heads:
        raise ValueError(f"`dim` ({dim!r}) must be a positive multiple of `heads` ({heads!r}), both whole numbers")


def with_key_padding(x, key_padding_mask):
    """The state of layers built with ``key_padding=True``: tokens ``x`` (..., tokens, dim) and one more channel,
    1 at the tokens ``key_padding_mask`` (bool, (..., tokens), True at padding: ``nn.MultiheadAttention``'s
    ``key_padding_mask``) marks, 0 at the others. The marked tokens are set to 0: what a batch's padding held
    (another sequence's values, NaN) reaches nothing.

    The mask travels inside the state, so that every layer evaluation (on every level, interval and rank of
    an MGRIT solve) reads the mask of the sequences it steps; the layers leave the channel and the padding
    tokens unchanged (their right-hand side is 0 there) and take no gradient through the channel. A layer
    reads every token whose channel is not 0 as padding: a scheme of one's own that scales the state
    (``u exp(-dt) + ...``) keeps the mask too.
    :func:`without_key_padding` strips it.

    >>> import torch
    >>> u = with_key_padding(torch.zeros(2, 3, 4), torch.tensor([[False, False, True], [False, False, False]]))
    >>> u.shape, u[..., -1].tolist()
    (torch.Size([2, 3, 5]), [[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"with_key_padding expects floating-point tokens (..., tokens, dim), got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
        got = getattr(key_padding_mask, "dtype", type(key_padding_mask).__name__)
        raise TypeError(f"key_padding_mask must be a bool tensor (..., tokens), True at padding (as for "
                        f"nn.MultiheadAttention), got {got}")
    if x.dim() < 2 or tuple(key_padding_mask.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"key_padding_mask must have the tokens' leading shape {tuple(x.shape[:-1])} (tokens "
                         f"(..., tokens, dim)), got {tuple(key_padding_mask.shape)}")
    if key_padding_mask.device != x.device:
        raise ValueError(f"key_padding_mask is on {key_padding_mask.device}, the tokens on {x.device}: move the mask "
                         f"there (mask.to({str(x.device)!r}))")
    return torch.cat([x.masked_fill(key_padding_mask[..., None], 0.0), key_padding_mask[..., None].to(x.dtype)],
                     dim=-1)


def without_key_padding(u):
    """The tokens of a state made by :func:`with_key_padding`: its padding channel stripped."""
    return u[..., :-1]


def _split_padding(layer, u):
    """``(tokens, padding (bool, (..., tokens)) or None)`` of a layer's state (a layer with a LayerNorm
    ``norm`` of the tokens' width); a clear error for another width. Padding: a channel that is not 0."""
    dim = layer.norm.normalized_shape[-1]
    width = dim + layer.key_padding
    if u.shape[-1] != width:
        what = ("the tokens and a padding channel: with_key_padding(x, mask)" if layer.key_padding else
                "tokens (for a state with a padding channel build the layers with key_padding=True)")
        raise ValueError(f"{type(layer).__name__} of dim {dim} expects states of width {width} ({what}), "
                         f"got shape {tuple(u.shape)}")
    if not layer.key_padding:
        return u, None
    return u[..., :-1], u[..., -1] != 0


def _with_zero_channel(z, padding):
    """A right-hand side ``z`` with the padding channel's 0 appended (when the state has one), and 0 at the
    padding tokens: they keep their values, so that they add nothing to the solves' residuals (a tolerance
    stops after the same cycles however much a batch is padded)."""
    if padding is None:
        return z
    return torch.cat([z.masked_fill(padding[..., None], 0.0), z.new_zeros(z.shape[:-1] + (1,))], dim=-1)


def _check_width(dim: int, mlp_ratio) -> int:
    """The MLP's hidden width ``round(mlp_ratio dim)``, at least 1 (a width of 0 makes the branch a constant)."""
    ratio = check_real(mlp_ratio, "mlp_ratio", 0.0)
    if int(round(ratio * dim)) < 1:
        raise ValueError(f"`mlp_ratio`={mlp_ratio!r} gives the MLP a hidden width of 0 for dim {dim}: pass a ratio "
                         f">= {0.5 / dim:g}")
    return int(round(ratio * dim))


class AttentionLayer(nn.Module):
    """Pre-norm multi-head self-attention ``Attn(LN(u))`` (the residual branch only).

    Parameters
    ----------
    dim, heads : int
        Token width and number of heads (``dim % heads == 0``).
    causal : bool
        Token ``i`` attends to tokens ``<= i`` only (decoder-style mask).
    dropout : float
        Dropout on the attention weights and the output (default 0). In
        ``LayerParallel`` every mask is drawn once per pass, in serial layer
        order (docs/norm_dropout.md), so training matches the serial network.
    bias : bool
        Biases of the query/key/value and output projections.
    key_padding : bool
        The state carries a padding channel (:func:`with_key_padding`): no
        token but itself attends to the tokens it marks, and those keep their
        values (the output is 0 there).

    The state has shape ``(..., tokens, dim)`` (``dim + 1`` with
    ``key_padding``); the output has the same shape (0 in the padding channel).
    """

    key_padding = False  # (the default of layers pickled before the option existed)

    def __init__(self, dim: int, heads: int, causal: bool = False, dropout: float = 0.0, bias: bool = True,
                 key_padding: bool = False):
        super().__init__()
        _check_dims(dim, heads)
        self.dim, self.heads, self.causal = int(dim), int(heads), check_flag(causal, "causal")
        self.key_padding = check_flag(key_padding, "key_padding")
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=bias)
        self.proj = nn.Linear(dim, dim, bias=bias)
        self.attn_drop = nn.Dropout(dropout)
        self.out_drop = nn.Dropout(dropout)

    @staticmethod
    def _drop(drop: nn.Dropout, x):
        return x if drop.p == 0 else drop(x)  # no random draw at all without dropout

    def forward(self, u):
        u, padding = _split_padding(self, u)
        n_tok, d, H = u.shape[-2], self.dim, self.heads
        lead = u.shape[:-2]
        q, k, v = self.qkv(self.norm(u)).chunk(3, dim=-1)

        def heads(z):  # (..., tokens, dim) -> (..., heads, tokens, dim / heads)
            return z.reshape(*lead, n_tok, H, d // H).transpose(-2, -3)

        q, k, v = heads(q), heads(k), heads(v)
        scores = q @ k.transpose(-1, -2) * (1.0 / math.sqrt(d // H))
        mask = torch.ones(n_tok, n_tok, dtype=torch.bool, device=u.device).triu(1) if self.causal else None
        if padding is not None:  # (keys marked in each sequence, for every head and query; a padding query keeps
            #                       its own key, so that no row of the softmax is masked whole: NaN there would
            #                       reach the gradients of the projections, although its output is 0)
            keys = padding[..., None, None, :] & ~torch.eye(n_tok, dtype=torch.bool, device=u.device)
            mask = keys if mask is None else mask | keys
        if mask is not None:
            scores = scores.masked_fill(mask, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        out = (self._drop(self.attn_drop, weights) @ v).transpose(-2, -3).reshape(*lead, n_tok, d)
        return _with_zero_channel(self._drop(self.out_drop, self.proj(out)), padding)


class MLPLayer(nn.Module):
    """Pre-norm MLP ``W2 gelu(W1 LN(u))`` (the residual branch only); with ``key_padding`` the state's
    padding channel (:func:`with_key_padding`) is passed over (0 in the output)."""

    key_padding = False  # (the default of layers pickled before the option existed)

    @property
    def dim(self) -> int:
        """The tokens' width."""
        return self.norm.normalized_shape[-1]

    def __init__(self, dim: int, hidden: int | None = None, dropout: float = 0.0, key_padding: bool = False):
        super().__init__()
        hidden = 4 * dim if hidden is None else int(hidden)
        self.key_padding = check_flag(key_padding, "key_padding")
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, u):
        u, padding = _split_padding(self, u)
        z = self.fc2(F.gelu(self.fc1(self.norm(u))))
        return _with_zero_channel(z if self.drop.p == 0 else self.drop(z), padding)


class TransformerBlock(nn.Module):
    """One pre-norm transformer block as the right-hand side ``F`` of one layer.

    ``form="sequential"``: ``F(u) = a + MLP(LN2(u + a))`` with ``a = Attn(LN1(u))``,
    so that ``u + F(u)`` is exactly the standard pre-norm block (attention,
    residual add, MLP, residual add) and ``u + h F(u)`` its ODE step.
    ``form="parallel"``: ``F(u) = Attn(LN1(u)) + MLP(LN2(u))`` (both branches
    read ``u``, as in GPT-J / PaLM blocks). ``key_padding=True``: the state
    carries a padding channel (:func:`with_key_padding`), see :class:`AttentionLayer`.
    """

    def __init__(self, dim: int, heads: int, mlp_ratio: float = 4.0, form: str = "sequential",
                 causal: bool = False, dropout: float = 0.0, key_padding: bool = False):
        super().__init__()
        if form not in ("sequential", "parallel"):
            raise ValueError(f"`form` must be 'sequential' or 'parallel' for one block, got {form!r} "
                             "(two half-step layers per block: transformer_layers(..., form='halves'))")
        self.form = form
        self.attn = AttentionLayer(dim, heads, causal=causal, dropout=dropout, key_padding=key_padding)
        self.mlp = MLPLayer(dim, _check_width(dim, mlp_ratio), dropout=dropout, key_padding=key_padding)

    def forward(self, u):
        a = self.attn(u)
        return a + self.mlp(u + a if self.form == "sequential" else u)


def transformer_layers(n_blocks: int, dim: int, heads: int, mlp_ratio: float = 4.0, form: str = "sequential",
                       causal: bool = False, dropout: float = 0.0, key_padding: bool = False) -> list:
    """The layer modules of ``n_blocks`` blocks: ``n_blocks`` :class:`TransformerBlock`
    (``form`` "sequential" or "parallel"), or ``2 n_blocks`` alternating
    :class:`AttentionLayer`, :class:`MLPLayer` (``form="halves"``). ``key_padding=True``: states
    with a padding channel (:func:`with_key_padding`; sequences of different lengths in one batch).

    >>> import torch
    >>> from propagators.torch import LayerParallel
    >>> lp = LayerParallel(transformer_layers(4, 8, 2, key_padding=True), T=1.0, cf=2)
    >>> x, mask = torch.randn(2, 5, 8), torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    >>> without_key_padding(lp(with_key_padding(x, mask))).shape   # the second sequence: 3 tokens
    torch.Size([2, 5, 8])
    """
    check_integer(n_blocks, "n_blocks", 1)
    if form not in FORMS:
        raise ValueError(f"`form` must be one of {FORMS}, got {form!r}")
    _check_dims(dim, heads)
    if form == "halves":
        out = []
        for _ in range(n_blocks):
            out += [AttentionLayer(dim, heads, causal=causal, dropout=dropout, key_padding=key_padding),
                    MLPLayer(dim, _check_width(dim, mlp_ratio), dropout=dropout, key_padding=key_padding)]
        return out
    return [TransformerBlock(dim, heads, mlp_ratio, form=form, causal=causal, dropout=dropout,
                             key_padding=key_padding) for _ in range(n_blocks)]


class PatchEmbedding(nn.Module):
    """Flat square images ``(batch, side * side)`` -> tokens ``(batch, tokens, dim)``.

    The image is cut into ``patch x patch`` patches (row by row), each mapped
    linearly to ``dim``, plus a learned position embedding; with ``cls_token``
    a learned class token is prepended.
    """

    def __init__(self, side: int, patch: int, dim: int, channels: int = 1, cls_token: bool = True):
        super().__init__()
        if not (is_integer(patch) and is_integer(side) and patch >= 1 and side >= 1):
            raise ValueError(f"the image side and the patch size must be positive whole numbers, got side {side!r} "
                             f"and patch {patch!r}")
        check_integer(channels, "channels", 1)
        check_integer(dim, "dim", 1)
        if side % patch:
            raise ValueError(f"the patch size {patch} must divide the image side {side}")
        self.side, self.patch, self.channels = int(side), int(patch), int(channels)
        self.n_patches = (side // patch) ** 2
        self.proj = nn.Linear(channels * patch * patch, dim)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim)) if cls_token else None
        n_tok = self.n_patches + (1 if cls_token else 0)
        self.pos = nn.Parameter(0.02 * torch.randn(1, n_tok, dim))

    def forward(self, x):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"the patch embedding expects a floating-point image tensor, got {type(x).__name__}; "
                            "convert it, e.g. torch.as_tensor(x).float()")
        dtype = self.pos.dtype  # the model's (a quantized projection's weight is a method)
        if not x.is_floating_point() or x.dtype != dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(f"the patch embedding expects a floating-point image tensor of the model's dtype "
                            f"({dtype}), got dtype {x.dtype}; convert it, e.g. x.to({dtype}) (8-bit pixels "
                            f"scaled to [0, 1]: x.to({dtype}) / 255), or the model, e.g. model.to(x.dtype)")
        s, p, c = self.side, self.patch, self.channels
        shape = tuple(x.shape[1:])
        B = x.shape[0] if x.dim() else 0
        if x.dim() < 2 or shape not in ((c * s * s,), (c, s, s)) + (((s, s),) if c == 1 else ()):
            # (any shape of the right size passed before: a (N, 2, 8, 4) batch, or an NHWC image whose pixels
            # went into the wrong patches)
            raise ValueError(f"the patch embedding expects images of {c} channel(s) x {s} x {s} = {c * s * s} values "
                             f"per sample, shaped (batch, {c * s * s}) or (batch, {c}, {s}, {s})"
                             + (f" or (batch, {s}, {s})" if c == 1 else "") + f", got input of shape "
                             f"{tuple(x.shape)}; build the model for this size (e.g. make_vit(..., side=28) for "
                             "MNIST's 784 pixels, channels=... for colour), and put channels first "
                             "(x.permute(0, 3, 1, 2) for channels-last images)")
        img = x.reshape(B, c, s // p, p, s // p, p)
        patches = img.permute(0, 2, 4, 1, 3, 5).reshape(B, self.n_patches, c * p * p)
        tok = self.proj(patches)
        if self.cls is not None:
            tok = torch.cat([self.cls.expand(B, -1, -1), tok], dim=1)
        return tok + self.pos


class ClassifierHead(nn.Module):
    """LayerNorm, then the class token (``pool="cls"``) or the token mean (``"mean"``), then a linear map.
    ``key_padding=True``: states with a padding channel (:func:`with_key_padding`), the mean over the tokens
    it does not mark (0 for a sequence of padding only); ``"cls"`` reads token 0 whatever the mask says (put the
    class token first and pad on the right)."""

    key_padding = False  # (the default of heads pickled before the option existed)

    @property
    def dim(self) -> int:
        """The tokens' width."""
        return self.norm.normalized_shape[-1]

    def __init__(self, dim: int, classes: int, pool: str = "cls", key_padding: bool = False):
        super().__init__()
        if pool not in ("cls", "mean"):
            raise ValueError(f"`pool` must be 'cls' or 'mean', got {pool!r}")
        check_integer(classes, "classes", 1)
        self.pool, self.key_padding = pool, check_flag(key_padding, "key_padding")
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, classes)

    def forward(self, u):
        u, padding = _split_padding(self, u)
        z = self.norm(u)
        if self.pool == "cls":
            return self.fc(z[:, 0])
        if padding is None:
            return self.fc(z.mean(dim=1))
        keep = (~padding)[..., None].to(z.dtype)
        return self.fc((z * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1.0))


class ViT(nn.Module):
    """``close(blocks(open(x)))``: patch embedding, transformer blocks, classifier head.

    ``blocks`` is a :class:`~propagators.torch.switch.Switchable` around a
    :class:`~propagators.torch.LayerParallel` (``vit.lp``) or, for a network
    built with ``parallel=False``, the serial :class:`~propagators.torch.ODENet`.
    """

    def __init__(self, open: nn.Module, blocks: nn.Module, close: nn.Module):
        super().__init__()
        self.open, self.blocks, self.close = open, blocks, close

    @property
    def lp(self) -> LayerParallel | None:
        return self.blocks.lp if isinstance(self.blocks, Switchable) else None

    def to_serial(self, root: int = 0) -> "ViT | None":
        """The serial ViT with the current weights: the structure and state-dict keys of
        ``make_vit(..., parallel=False)`` (blocks an :class:`~propagators.torch.ODENet`), deep copies.

        Collective over the blocks' communicator (:meth:`LayerParallel.to_serial`); returns the
        network on rank ``root`` and None on the other ranks. Its ``state_dict()`` loads into a
        ``parallel=False`` ViT, and back with :meth:`load_serial`.
        """
        lp = self.lp
        if lp is None:
            return copy.deepcopy(self)
        blocks = lp.to_serial(root)
        if blocks is None:
            return None
        return ViT(copy.deepcopy(self.open), blocks, copy.deepcopy(self.close)).train(self.training)

    def serial_state_dict(self, root: int = 0):
        """:meth:`to_serial`'s state dict (copies), gathered as tensors: on rank ``root``, None on the others
        (:meth:`LayerParallel.serial_state_dict`; collective). It also serves layers torch does not pickle."""
        lp = self.lp
        if lp is None:
            return _copied(self.state_dict())
        blocks = lp.serial_state_dict(root)
        if blocks is None:
            return None
        out = {f"open.{k}": v for k, v in _copied(self.open.state_dict()).items()}
        out.update((f"blocks.{k}", v) for k, v in blocks.items())
        out.update((f"close.{k}", v) for k, v in _copied(self.close.state_dict()).items())
        return out

    def load_serial(self, state_dict: dict, strict: bool = True):
        """Load a serial ViT's state dict (``to_serial().state_dict()``, or a ``parallel=False``
        ViT's) on every rank: the embedding and head take their entries, the blocks the entries of
        the layers each rank holds (:meth:`LayerParallel.load_serial`; collective)."""
        lp = self.lp
        if lp is None:
            return self.load_state_dict(state_dict, strict=strict)
        prefix = "blocks."
        if any(k.startswith("blocks.lp.") for k in state_dict):
            raise KeyError("this is a layer-parallel ViT's own state dict (keys blocks.lp....): load it with "
                           "load_state_dict on the same ranks; load_serial takes a serial ViT's state dict "
                           "(vit.to_serial().state_dict() or make_vit(..., parallel=False).state_dict())")
        own = {k for k in self.state_dict() if not k.startswith(prefix)}
        rest = {k: v for k, v in state_dict.items() if not k.startswith(prefix)}
        missing, extra = sorted(own - set(rest)), sorted(set(rest) - own)

        def check():  # (in the blocks' session, before anything is loaded: a failure on one rank reaches all)
            if strict and (missing or extra):
                raise KeyError(f"the state dict does not fit this ViT's embedding and head: missing {missing[:3]}, "
                               f"unexpected {extra[:3]} (a serial ViT's state dict is expected: vit.to_serial()"
                               ".state_dict() or make_vit(..., parallel=False).state_dict())")

        keys = lp.load_serial({k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)},
                              strict=strict, prefix=prefix,
                              _also=(check, lambda: self.load_state_dict(rest, strict=False)))
        return nn.modules.module._IncompatibleKeys(missing + [prefix + k for k in keys.missing_keys],
                                                   extra + [prefix + k for k in keys.unexpected_keys])

    def forward(self, x):
        return self.close(self.blocks(self.open(x)))


def make_vit(n_blocks: int = 8, dim: int = 32, heads: int = 4, *, side: int = 8, patch: int = 4,
             channels: int = 1, classes: int = 10, mlp_ratio: float = 2.0, form: str = "sequential",
             pool: str = "cls", causal: bool = False, dropout: float = 0.0, T: float | None = 1.0,
             init: str = "repeat", parallel: bool = True, seed: int | None = None, **lp_options) -> ViT:
    """A small vision transformer whose blocks are one :class:`LayerParallel` module.

    Parameters
    ----------
    n_blocks, dim, heads, mlp_ratio, form, causal, dropout
        The blocks (:func:`transformer_layers`); ``form="halves"`` gives
        ``2 n_blocks`` layers.
    side, patch, channels, classes, pool
        Images of ``side x side`` pixels (flat input ``(batch, channels * side**2)``),
        ``patch x patch`` patches as tokens, the head's classes and pooling
        (``"cls"``: a class token; ``"mean"``: the token mean).
    T : float or None
        Final time; the layer step is ``h = T / n_layers``. Default 1: the
        residual branches scaled by ``1 / n_layers``, on which MGRIT's coarse
        steps are more accurate; None: ``T = n_layers``, ``h = 1``, the
        standard transformer (docs/transformer.md §1).
    parallel : bool
        True: ``LayerParallel`` blocks in a :class:`Switchable`; False: the
        serial ``ODENet`` of the same layers.
    init : {"repeat", "independent"}
        ``"repeat"``: every layer starts with the weights of the first (of its
        kind), a right-hand side that is constant in layer-time, on which the
        coarse levels of MGRIT are accurate; ``"independent"``: PyTorch's
        default initialisation of each layer (docs/transformer.md compares them).
    seed : int, optional
        ``torch.manual_seed(seed)`` before building: two calls with the same
        seed build the same weights, whatever ``parallel`` and ``lp_options``.
    **lp_options
        Passed to :class:`LayerParallel` (``cf``, ``max_levels``, ``fwd_iters``,
        ``bwd_iters``, ``fwd_tol``, ``comm``, ...).

    Examples
    --------
    >>> import torch
    >>> vit = make_vit(4, 8, 2, seed=0, cf=2)     # 8 x 8 images, 4 x 4 patches: 4 tokens + a class token
    >>> vit(torch.randn(3, 64)).shape
    torch.Size([3, 10])
    >>> vit.blocks.mode = "serial"               # the same parameters, plain autograd through the blocks
    """
    check_integer(n_blocks, "n_blocks", 1)
    _check_dims(dim, heads)
    causal, parallel = check_flag(causal, "causal"), check_flag(parallel, "parallel")
    if "key_padding" in lp_options:
        raise TypeError("make_vit builds a model of images, whose token count is fixed: it takes no key_padding; for "
                        "sequences of different lengths build transformer_layers(..., key_padding=True) and "
                        "ClassifierHead(..., key_padding=True) around a LayerParallel (docs/transformer.md §1)")
    if causal and pool == "cls":
        raise ValueError("causal=True with pool='cls': the class token stands in front of the patches and causal "
                         "attention lets it see only itself, so the classifier would ignore the image; use "
                         "pool='mean' with causal attention")
    if seed is not None:
        torch.manual_seed(seed)
    open_ = PatchEmbedding(side, patch, dim, channels, cls_token=pool == "cls")
    layers = transformer_layers(n_blocks, dim, heads, mlp_ratio, form=form, causal=causal, dropout=dropout)
    if init == "repeat":
        period = 2 if form == "halves" else 1
        with torch.no_grad():
            for j in range(period, len(layers)):
                layers[j].load_state_dict(layers[j % period].state_dict())
    elif init != "independent":
        raise ValueError(f"`init` must be 'repeat' or 'independent', got {init!r}")
    close = ClassifierHead(dim, classes, pool)
    T = float(len(layers)) if T is None else float(T)
    if parallel:
        blocks: nn.Module = Switchable(LayerParallel(layers, T=T, **lp_options))
    else:
        if lp_options:
            raise TypeError(f"LayerParallel options {sorted(lp_options)} were given with parallel=False")
        blocks = ODENet(layers, T=T)
    return ViT(open_, blocks, close)
