"""The golden-graph corpus: small models that each exercise one ownership case.

Every entry builds ``(model, example_inputs)`` from a seed with random weights; nothing is
downloaded. Used by the golden tests, ``graphpass explain graphpass.models.corpus:NAME`` and the
benchmarks.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .transformer import TinyTransformer, TransformerConfig

# ------------------------------------------------------------------ MLP stack


class MLPBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class MLPStack(nn.Module):
    def __init__(self, dim: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.proj_in = nn.Linear(dim, dim)
        self.layers = nn.ModuleList(MLPBlock(dim) for _ in range(depth))
        self.head = nn.Linear(dim, 8)

    def forward(self, x):
        x = self.proj_in(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


# ------------------------------------------------------------------ MoE (fused-expert parameters)


class MoE(nn.Module):
    """Experts stored vLLM-style as two stacked tensors: ``w13_weight`` [E, 2I, H], ``w2_weight`` [E, H, I]."""

    def __init__(self, hidden: int = 32, inter: int = 48, experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.w13_weight = nn.Parameter(torch.randn(experts, 2 * inter, hidden) * 0.05)
        self.w2_weight = nn.Parameter(torch.randn(experts, hidden, inter) * 0.05)

    def forward(self, x):
        probs = F.softmax(self.gate(x), dim=-1)
        top, idx = probs.topk(self.top_k, dim=-1)
        weights = torch.zeros_like(probs).scatter(-1, idx, top / top.sum(-1, keepdim=True))
        gate_up = torch.einsum("th,eih->tei", x, self.w13_weight)
        gate, up = gate_up.chunk(2, dim=-1)
        expert_out = torch.einsum("tei,ehi->teh", F.silu(gate) * up, self.w2_weight)
        return torch.einsum("teh,te->th", expert_out, weights)


class MoELayer(nn.Module):
    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.moe = MoE(hidden)

    def forward(self, x):
        return x + self.moe(self.norm(x))


class MoEModel(nn.Module):
    def __init__(self, hidden: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MoELayer(hidden) for _ in range(depth))
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


# ------------------------------------------------------------------ quantized linear with weight.scale


class QuantLinear(nn.Module):
    """int8 weight with a per-output-channel ``weight.scale`` inner tensor field (FP8/INT8 style)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        w = torch.randn(out_features, in_features)
        scale = w.abs().amax(dim=1) / 127.0
        self.weight = nn.Parameter(torch.round(w / scale[:, None]).to(torch.int8), requires_grad=False)
        self.weight.scale = scale
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x):
        return F.linear(x, self.weight.to(x.dtype) * self.weight.scale[:, None], self.bias)


class QuantBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = QuantLinear(dim, 2 * dim)
        self.down = QuantLinear(2 * dim, dim)

    def forward(self, x):
        return x + self.down(F.relu(self.up(x)))


class QuantModel(nn.Module):
    def __init__(self, dim: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(QuantBlock(dim) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


# ------------------------------------------------------------------ custom op reading the weights


@torch.library.custom_op("graphpass_models::fused_mlp", mutates_args=())
def fused_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Stands in for a fused kernel (Triton, CUDA) that reads its weights directly."""
    gate, up = (x @ w13.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w2.t()


@fused_mlp.register_fake
def _fused_mlp_fake(x, w13, w2):
    return x.new_empty(*x.shape[:-1], w2.shape[0])


def _fused_mlp_backward(ctx, grad):
    x, w13, w2 = ctx.saved_tensors
    with torch.enable_grad():
        x_, w13_, w2_ = (t.detach().requires_grad_(True) for t in (x, w13, w2))
        gate, up = (x_ @ w13_.t()).chunk(2, dim=-1)
        out = (F.silu(gate) * up) @ w2_.t()
        return torch.autograd.grad(out, (x_, w13_, w2_), grad)


def _fused_mlp_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


fused_mlp.register_autograd(_fused_mlp_backward, setup_context=_fused_mlp_setup)


class FusedMLP(nn.Module):
    def __init__(self, hidden: int = 32, inter: int = 64) -> None:
        super().__init__()
        self.w13_weight = nn.Parameter(torch.randn(2 * inter, hidden) * 0.05)
        self.w2_weight = nn.Parameter(torch.randn(hidden, inter) * 0.05)

    def forward(self, x):
        return torch.ops.graphpass_models.fused_mlp(x, self.w13_weight, self.w2_weight)


class CustomOpLayer(nn.Module):
    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.mlp = FusedMLP(hidden)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class CustomOpModel(nn.Module):
    def __init__(self, hidden: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CustomOpLayer(hidden) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


# ------------------------------------------------------------------ graph break inside the layer stack


class BreakingBlock(MLPBlock):
    def __init__(self, dim: int, breaks: bool) -> None:
        super().__init__(dim)
        self.breaks = breaks

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        if self.breaks:
            torch._dynamo.graph_break()
        return x + self.fc2(h)


class GraphBreakModel(nn.Module):
    """Layer 1 breaks the graph between its two linears: two Dynamo graphs, layer 1 in both."""

    def __init__(self, dim: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(BreakingBlock(dim, breaks=(i == 1)) for i in range(depth))
        self.head = nn.Linear(dim, 8)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


# ------------------------------------------------------------------ seed-style static-shape model


class SeedStyle(nn.Module):
    """The seed audit's static-able cases: position ids from arange, a fixed-size prefix token
    concatenated along the variable length, a mask-token embedding, a row-wise MLP."""

    def __init__(self, vocab: int = 64, hidden: int = 16, max_len: int = 128) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(max_len, hidden)
        self.prefix = nn.Parameter(torch.randn(1, 1, hidden))
        self.mask_token = nn.Parameter(torch.randn(hidden))
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))

    def forward(self, ids):
        b, n = ids.shape
        x = self.emb(ids) + self.pos(torch.arange(n)) + self.mask_token * (ids == 0).unsqueeze(-1)
        x = torch.cat([self.prefix.expand(b, 1, x.shape[-1]), x], dim=1)
        return self.mlp(x)


# ------------------------------------------------------------------ the corpus


def _x(seed: int, *shape: int) -> tuple[torch.Tensor]:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)),)


def _tiny_transformer(seed: int):
    torch.manual_seed(seed)
    model = TinyTransformer(TransformerConfig(vocab=64, hidden=32, heads=2, layers=2, mlp=64))
    return model, model.example_inputs(batch=2, seq=8, seed=seed)


def _seeded(cls, *inputs_shape, **kw):
    def factory(seed: int):
        torch.manual_seed(seed)
        return cls(**kw), _x(seed + 1, *inputs_shape)

    return factory


CORPUS: dict[str, Callable[[int], tuple[nn.Module, tuple]]] = {
    "mlp_stack": _seeded(MLPStack, 4, 32),
    "tiny_transformer": _tiny_transformer,
    "moe": _seeded(MoEModel, 6, 32),
    "quant_linear": _seeded(QuantModel, 4, 32),
    "custom_op": _seeded(CustomOpModel, 4, 32),
    "graph_break": _seeded(GraphBreakModel, 4, 32),
}


def build(name: str, seed: int = 0) -> tuple[nn.Module, tuple]:
    """``(model, example_inputs)`` for corpus entry ``name``."""
    return CORPUS[name](seed)


def demo_model(seed: int = 0) -> tuple[nn.Module, tuple]:
    """The model ``make demo`` runs: :class:`TinyTransformer` with its default config."""
    torch.manual_seed(seed)
    model = TinyTransformer()
    return model, model.example_inputs(batch=2, seq=32, seed=seed)


def mlp_stack():
    return build("mlp_stack")


def tiny_transformer():
    return build("tiny_transformer")


def moe():
    return build("moe")


def quant_linear():
    return build("quant_linear")


def custom_op():
    return build("custom_op")


def graph_break():
    return build("graph_break")
