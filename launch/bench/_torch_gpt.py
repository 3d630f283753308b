"""The GPT of :mod:`launch.examples.gpt` written in PyTorch, and its torch parallel layouts,
for :mod:`launch.bench.gpt_vs_torch`. Imports torch at import: import it only where torch
is installed.

:class:`TorchGPT` mirrors ``launch.examples.gpt.GPT`` module for module: the same module
paths and parameter names and shapes (``tok_emb``, ``pos_emb``, ``blocks.<i>.ln1``,
``blocks.<i>.attn.{wq,wk,wv,wo}``, ``blocks.<i>.ln2``, ``blocks.<i>.mlp.{fc,proj}``,
``ln_f``, ``head`` tied to ``tok_emb.weight``), the same computation (pre-norm blocks,
causal ``scaled_dot_product_attention`` on heads split by ``view(B, S, -1, head_dim)``,
exact (erf) GELU, mean cross-entropy of the flattened logits). Its initial values do not
matter: :func:`load_numpy` copies dtensor's in.

:func:`build` lays it out as a benchmark mode says: ``local`` (the module itself), ``dp``
(``DistributedDataParallel``), ``fsdp`` (FSDP2: ``torch.distributed.fsdp.fully_shard`` on
every block, then on the root, as ``gpt_strategies`` does) or ``tp`` (``parallelize_module``
with the Megatron plan of ``launch.examples.gpt.tp_plan``: ``wq``/``wk``/``wv``/``fc``
colwise, ``wo``/``proj`` rowwise).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        d = cfg.d_model
        self.head_dim = d // cfg.n_head
        self.wq = nn.Linear(d, d, bias=cfg.bias)
        self.wk = nn.Linear(d, d, bias=cfg.bias)
        self.wv = nn.Linear(d, d, bias=cfg.bias)
        self.wo = nn.Linear(d, d, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        hd = self.head_dim
        q = self.wq(x).view(b, s, -1, hd).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, hd).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(b, s, -1)
        return self.wo(y)


class MLP(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TorchGPT(nn.Module):
    """``TorchGPT(cfg)(idx, targets)``: the mean next-token cross-entropy; without targets
    the logits. The twin of ``launch.examples.gpt.GPT``. **Local**."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        s = idx.shape[1]
        pos = torch.arange(s, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def load_numpy(model: nn.Module, weights: Mapping[str, np.ndarray]) -> None:
    """Copy full float32 arrays into ``model``'s parameters by name (every parameter of the
    model must be given, with its shape). **Local**."""
    params = dict(model.named_parameters())
    missing = set(params) ^ set(weights)
    if missing:
        raise KeyError(f"load_numpy: parameters not matched by name: {sorted(missing)}")
    with torch.no_grad():
        for name, p in params.items():
            a = weights[name]
            if tuple(a.shape) != tuple(p.shape):
                raise ValueError(f"load_numpy: {name} has shape {tuple(p.shape)}, the array "
                                 f"{tuple(a.shape)}")
            p.copy_(torch.from_numpy(np.ascontiguousarray(a)))


def tp_plan() -> dict:
    """The Megatron plan of the blocks in torch's styles (``gpt.tp_plan()``'s twin)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "blocks.*.attn.wq": ColwiseParallel(),
        "blocks.*.attn.wk": ColwiseParallel(),
        "blocks.*.attn.wv": ColwiseParallel(),
        "blocks.*.attn.wo": RowwiseParallel(),
        "blocks.*.mlp.fc": ColwiseParallel(),
        "blocks.*.mlp.proj": RowwiseParallel(),
    }


def build(mode: str, cfg: Any, weights: Mapping[str, np.ndarray], rank: int,
          world: int) -> tuple[nn.Module, int, int]:
    """The torch GPT with ``weights`` laid out as ``mode`` says, and its data-parallel
    split: ``(model, n_data, data_rank)``. **Collective** over the default process group
    (except ``local``)."""
    model = TorchGPT(cfg)
    load_numpy(model, weights)
    if mode == "local":
        return model, 1, 0
    if mode in ("dp", "replicate"):
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model), world, rank
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, world, rank
    if mode == "tp":
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, mesh, tp_plan())
        return model, 1, 0
    raise ValueError(f"torch build: no mode {mode!r} (local, dp, replicate, fsdp, tp)")
