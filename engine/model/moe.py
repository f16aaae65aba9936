"""A top-k mixture-of-experts MLP (GPT-OSS's; spec.MoeSpec), the way transformers' GptOssMLP computes it.

Per token the router (a linear with bias) scores every expert, the top_k are kept and their logits softmaxed into
weights; each chosen expert runs gate_up -> clamped SwiGLU -> down on the token, and the outputs are summed by those
weights. Only the experts some token chose run, each once over its tokens (a loop over experts: for the small
models this serves, that is the simple and fast way). Shapes: T tokens, E experts, k = top_k, I intermediate size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[..., 2I] with gate and up interleaved by column -> [..., I]: (up + 1) * gate * sigmoid(alpha * gate), the
    gate clamped to at most `limit` and up to [-limit, limit] first (GptOssExperts._apply_gate)."""
    gate, up = gate_up[..., ::2].clamp(max=limit), gate_up[..., 1::2].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


@dataclass
class MoeMLP:
    """One layer's experts, as the checkpoint stores them: [E, in, out] matrices (x @ w), biases [E, out]."""

    router: torch.Tensor  # [E, hidden]
    router_bias: torch.Tensor  # [E]
    gate_up: torch.Tensor  # [E, hidden, 2I], gate and up interleaved by column
    gate_up_bias: torch.Tensor  # [E, 2I]
    down: torch.Tensor  # [E, I, hidden]
    down_bias: torch.Tensor  # [E, hidden]
    top_k: int
    alpha: float
    limit: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden] in x's dtype."""
        logits = F.linear(x, self.router, self.router_bias)  # [T, E]
        top, experts = torch.topk(logits, self.top_k, dim=-1)  # [T, k]
        weights = torch.softmax(top, dim=-1)  # [T, k], in x's dtype as transformers'
        out = torch.empty((*experts.shape, x.shape[-1]), dtype=x.dtype, device=x.device)  # [T, k, hidden]
        for e in torch.unique(experts).tolist():  # the chosen experts only (on CUDA: one sync a layer)
            token, slot = torch.where(experts == e)
            h = clamped_swiglu(x[token] @ self.gate_up[e] + self.gate_up_bias[e], self.alpha, self.limit)
            out[token, slot] = (h @ self.down[e] + self.down_bias[e]) * weights[token, slot, None]
        return out.sum(dim=1)  # the k experts' weighted outputs, summed as transformers' grouped path sums them
