"""A GPT of ``dt.nn`` modules: token and position embeddings, pre-norm blocks of causal
multi-head self-attention and a GELU MLP, a final LayerNorm and a head tied to the token
embedding. The model of the training examples, the strategy tests and the benchmarks.

Module paths (what parallel plans name): ``tok_emb``, ``pos_emb``, ``blocks.<i>.ln1``,
``blocks.<i>.attn.{wq,wk,wv,wo}``, ``blocks.<i>.ln2``, ``blocks.<i>.mlp.{fc,proj}``,
``ln_f``, ``head`` (its weight is ``tok_emb.weight``).

A stage module of ``dt.pipelining.pipeline_split`` runs the same ``forward``: the
embeddings (with ``pos_emb`` and ``drop``) and ``ln_f`` with ``head`` are None where the
stage lacks them (split points at ``blocks.<i>`` keep each pair together); the first stage
takes token ids, the others hidden states, and only the last returns logits.

The attention splits its projections into heads with ``view(B, S, -1, head_dim)``, so
the same code runs on full projections and on the column shards of tensor parallelism
(each rank then holds ``n_head / tp`` heads).
"""

from __future__ import annotations

from dataclasses import dataclass

import dtensor as dt

F = dt.nn.functional


@dataclass(frozen=True)
class GPTConfig:
    """The sizes of a :class:`GPT`."""

    vocab_size: int = 64
    block_size: int = 16
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 32
    dropout: float = 0.0
    bias: bool = True

    def n_params(self) -> int:
        """The parameter count (the tied head counted once)."""
        d, v = self.d_model, self.vocab_size
        b = 1 if self.bias else 0
        per_block = 2 * (2 * d) + 4 * (d * d + b * d) + (4 * d * d + b * 4 * d) + (
            4 * d * d + b * d)
        return v * d + self.block_size * d + self.n_layer * per_block + 2 * d

    def flops_per_token(self) -> int:
        """Training FLOPs per token (forward and backward): ``6 x parameters`` (every weight
        is used in one multiply-add forward and two backward; the tied head's matmul is the
        embedding's parameters) plus the attention scores and their weighted sum,
        ``12 x layers x d_model x block_size`` (PaLM's count, causal masking not
        discounted)."""
        return 6 * self.n_params() + 12 * self.n_layer * self.d_model * self.block_size


class CausalSelfAttention(dt.nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.head_dim = d // cfg.n_head
        self.wq = dt.nn.Linear(d, d, bias=cfg.bias)
        self.wk = dt.nn.Linear(d, d, bias=cfg.bias)
        self.wv = dt.nn.Linear(d, d, bias=cfg.bias)
        self.wo = dt.nn.Linear(d, d, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x):
        b, s = x.shape[0], x.shape[1]
        hd = self.head_dim
        q = self.wq(x).view(b, s, -1, hd).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, hd).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(b, s, -1)
        return self.wo(y)


class MLP(dt.nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = dt.nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.proj = dt.nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(dt.nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = dt.nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = dt.nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(dt.nn.Module):
    """``GPT(cfg)(idx)`` gives the logits ``(B, S, vocab)``; ``GPT(cfg)(idx, targets)``
    the mean cross-entropy of the next-token targets. ``positions`` (default
    ``arange(S)``) are the position ids of the tokens: under ``dt.context_parallel`` pass
    them as one of its buffers, so that they follow the load-balanced order. **Local** (its
    parameters' layouts decide which collectives a call runs)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = dt.nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = dt.nn.Embedding(cfg.block_size, cfg.d_model)
        self.drop = dt.nn.Dropout(cfg.dropout)
        self.blocks = dt.nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = dt.nn.LayerNorm(cfg.d_model)
        self.head = dt.nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied
        for name, p in self.named_parameters():
            if name.endswith(("wo.weight", "proj.weight")):  # GPT-2's scaled residual init
                dt.nn.init.normal_(p, std=0.02 / (2 * cfg.n_layer) ** 0.5)
            elif p.dim() == 2:
                dt.nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets=None, positions=None):
        x = idx
        if self.tok_emb is not None:  # None on the later stages of a pipeline split
            s = idx.shape[1]
            pos = dt.arange(s) if positions is None else positions
            if positions is None and isinstance(idx, dt.DTensor):
                # a sharded batch: the positions on every rank
                pos = dt.DTensor.from_local(pos, idx.device_mesh,
                                            [dt.Replicate()] * idx.device_mesh.ndim)
            x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:  # a pipeline stage holds some of them
            x = block(x)
        if self.head is None:  # not the last stage of a pipeline split
            return x
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def tp_plan(sequence_parallel: bool = False) -> dict:
    """The Megatron plan of the blocks (attention heads and the MLP split over the tp
    mesh); with ``sequence_parallel`` the LayerNorms and residuals between them hold
    ``Shard(1)`` (sequence) shards: one all-gather before the attention and the MLP,
    a reduce-scatter after wo and proj. Embeddings and the tied head stay whole."""
    if not sequence_parallel:
        return {
            "blocks.*.attn.wq": dt.ColwiseParallel(),
            "blocks.*.attn.wk": dt.ColwiseParallel(),
            "blocks.*.attn.wv": dt.ColwiseParallel(),
            "blocks.*.attn.wo": dt.RowwiseParallel(),
            "blocks.*.mlp.fc": dt.ColwiseParallel(),
            "blocks.*.mlp.proj": dt.RowwiseParallel(),
        }
    seq = dt.Shard(1)
    gather = {"input_layouts": (seq,), "desired_input_layouts": (dt.Replicate(),)}
    return {
        "blocks.0": dt.PrepareModuleInput(input_layouts=(dt.Replicate(),),
                                          desired_input_layouts=(seq,)),
        "blocks.*.ln*": dt.SequenceParallel(),
        "blocks.*.attn": dt.PrepareModuleInput(**gather),
        "blocks.*.attn.wq": dt.ColwiseParallel(),
        "blocks.*.attn.wk": dt.ColwiseParallel(),
        "blocks.*.attn.wv": dt.ColwiseParallel(),
        "blocks.*.attn.wo": dt.RowwiseParallel(output_layouts=seq, use_local_output=False),
        "blocks.*.mlp": dt.PrepareModuleInput(**gather),
        "blocks.*.mlp.fc": dt.ColwiseParallel(),
        "blocks.*.mlp.proj": dt.RowwiseParallel(output_layouts=seq, use_local_output=False),
        "ln_f": dt.PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(dt.Replicate(),),
                                      use_local_output=True),
    }


def batch(cfg: GPTConfig, batch_size: int, seed: int) -> tuple:
    """A deterministic next-token batch ``(idx, targets)`` of int64 numpy arrays, the same
    on every rank for a seed. **Local**."""
    import numpy as np  # lazy: only batch makes data

    rng = np.random.default_rng(seed)
    data = rng.integers(0, cfg.vocab_size, (batch_size, cfg.block_size + 1), dtype=np.int64)
    return data[:, :-1].copy(), data[:, 1:].copy()
