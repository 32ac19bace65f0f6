"""Plain-PyTorch float64 DIFF model written from the paper's equations (test reference only).

Weights are taken in *semantic* form (per-head Q1/Q2/K1/K2/V matrices, gate/up), never through diffmeg
code, so a layout or pairing mistake in diffmeg shows up as a mismatch.
"""

from __future__ import annotations

import math

import torch


def lambda_init(layer_index: int) -> float:
    return 0.8 - 0.6 * math.exp(-0.3 * layer_index)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def poly_norm(z: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Motif's PolyNorm over the last dimension: w0 norm(z^3) + w1 norm(z^2) + w2 norm(z) + b."""

    def norm(u):
        return u / torch.sqrt((u * u).mean(-1, keepdim=True) + eps)

    return w[0] * norm(z**3) + w[1] * norm(z**2) + w[2] * norm(z) + b[0]


def mlp(hn: torch.Tensor, lw: dict) -> torch.Tensor:
    """The gated MLP: down(act(gate hn) * up hn), act SwiGLU's silu or (`lw["poly_w"]` present) PolyNorm."""
    gate = hn @ lw["gate"].T
    act = poly_norm(gate, lw["poly_w"], lw["poly_b"]) if "poly_w" in lw else torch.nn.functional.silu(gate)
    return (act * (hn @ lw["up"].T)) @ lw["down"].T


def rope(x: torch.Tensor, base: float) -> torch.Tensor:
    """Non-interleaved (rotate-half) RoPE on x [s, heads, d], position = row index."""
    s, _, d = x.shape
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(s, dtype=torch.float64)[:, None] * inv[None, :]  # [s, d/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def diff_heads(q1, q2, k1, k2, v, lq1, lk1, lq2, lk2, norm_w, lam_init, eps=1e-5):
    """q1: [h, s, d] signal queries; q2: [n, s, d] noise queries (n = h: the paper's pairs; n < h: grouped
    differential attention, signal head i taking noise query i // (h / n)); k1, k2: [g, s, d]; v: [g, s, 2d]
    -> [s, h * 2d], one head at a time."""
    h, s, d = q1.shape
    n, g = q2.shape[0], k1.shape[0]
    lam = torch.exp(torch.dot(lq1, lk1)) - torch.exp(torch.dot(lq2, lk2)) + lam_init
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    outs = []
    for i in range(h):
        j = i // (h // g)  # the KV head of signal head i, which its group's noise head shares
        m = i // (h // n)  # its group's noise head
        s1 = (q1[i] @ k1[j].T) / math.sqrt(d)
        s2 = (q2[m] @ k2[m // (n // g)].T) / math.sqrt(d)
        a1 = torch.softmax(s1.masked_fill(~causal, -math.inf), -1)
        a2 = torch.softmax(s2.masked_fill(~causal, -math.inf), -1)
        o = (a1 - lam * a2) @ v[j]  # [s, 2d]
        outs.append(rmsnorm(o, norm_w, eps) * (1 - lam_init))
    return torch.cat(outs, dim=-1)


def reference_logits(tokens: torch.Tensor, w: dict, cfg: dict) -> torch.Tensor:
    """tokens [s] -> logits [s, vocab] of a DIFF model with semantic weights `w`."""
    x = w["embed"][tokens]  # [s, H]
    eps = cfg.get("eps", 1e-5)
    for li, lw in enumerate(w["layers"]):
        hn = rmsnorm(x, lw["input_norm"], eps)
        q1 = rope(torch.einsum("sH,hdH->shd", hn, lw["wq1"]), cfg["rotary_base"]).transpose(0, 1)
        q2 = rope(torch.einsum("sH,hdH->shd", hn, lw["wq2"]), cfg["rotary_base"]).transpose(0, 1)
        k1 = rope(torch.einsum("sH,gdH->sgd", hn, lw["wk1"]), cfg["rotary_base"]).transpose(0, 1)
        k2 = rope(torch.einsum("sH,gdH->sgd", hn, lw["wk2"]), cfg["rotary_base"]).transpose(0, 1)
        v = torch.einsum("sH,geH->sge", hn, lw["wv"]).transpose(0, 1)  # [g, s, 2d]
        # "motif": Motif's schedule, lambda_init(layer_idx - 1) for a 0-based layer_idx
        lam0 = cfg.get("lambda_init")
        lam0 = lambda_init(li) if lam0 is None else lambda_init(li - 1) if lam0 == "motif" else lam0
        attn = diff_heads(
            q1, q2, k1, k2, v, lw["lq1"], lw["lk1"], lw["lq2"], lw["lk2"], lw["head_norm"], lam0
        )
        x = x + attn @ lw["wo"].T
        hn = rmsnorm(x, lw["mlp_norm"], eps)
        x = x + mlp(hn, lw)
    return rmsnorm(x, w["final_norm"], eps) @ w["output"].T


def fused_qkv_blocks(qkv: torch.Tensor, query_heads: int, groups: int, d: int):
    """(query heads [q, d, H], keys [groups, d, H], values [groups, d, H]) of megatron-core's fused QKV
    weight: per group m, its query heads, one key, one value, d rows each; group m holds query heads
    floor(m q / groups) .. floor((m + 1) q / groups) (q / groups each where that divides)."""
    blocks = qkv.view(-1, d, qkv.shape[-1])  # [rows / d, d, H]
    queries, keys, values, row = [], [], [], 0
    for m in range(groups):
        count = (m + 1) * query_heads // groups - m * query_heads // groups
        queries.append(blocks[row : row + count])
        keys.append(blocks[row + count])
        values.append(blocks[row + count + 1])
        row += count + 2
    assert row == blocks.shape[0]
    return torch.cat(queries), torch.stack(keys), torch.stack(values)


def signal_and_noise(queries: torch.Tensor, noise: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Query heads [h + n, ...] laid out group by group [signal x r, noise] as (signal [h, ...], noise [n,
    ...]); r = 1 is the adjacent pairs 2i, 2i + 1."""
    per = queries.shape[0] // noise  # r + 1
    groups = queries.view(noise, per, *queries.shape[1:])
    return groups[:, : per - 1].reshape(-1, *queries.shape[1:]), groups[:, per - 1]


def semantic_weights_from_mcore(sd: dict, cfg: dict) -> dict:
    """Unpack a TP=1 megatron-core GPTModel state dict (local spec) into semantic float64 weights.

    Fused QKV rows per query sub-group (2g of them: sub-groups 2j / 2j+1 hold K1 / K2 and the first /
    second d-wide half of V of KV head j): [its query sub-heads of d, one key of d, one value of d]; the
    h + n query sub-heads (`cfg["noise_heads"]` n, default h) come group by group [signal x r, noise]
    (r = 1: sub-heads 2i / 2i+1 are Q1 / Q2 of head i).
    """
    h, g, d = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    n = cfg.get("noise_heads", h)
    # no detach: a test may differentiate the reference with respect to leaf copies of the state dict
    f64 = {k: v.to(torch.float64) for k, v in sd.items() if v is not None and hasattr(v, "dtype")}
    out = _global_weights(f64)
    for li in range(cfg["layers"]):
        p = f"decoder.layers.{li}."
        q, k_sub, v_sub = fused_qkv_blocks(f64[p + "self_attention.linear_qkv.weight"], h + n, 2 * g, d)
        wq1, wq2 = signal_and_noise(q, n)
        ca = p + "self_attention.core_attention."
        out["layers"].append(
            {
                **_dense_weights(f64, p),
                "wq1": wq1,
                "wq2": wq2,
                "wk1": k_sub[0::2],
                "wk2": k_sub[1::2],
                "wv": torch.cat([v_sub[0::2], v_sub[1::2]], dim=1),  # [g, 2d, H]
                "lq1": f64[ca + "lambda_q1"],
                "lk1": f64[ca + "lambda_k1"],
                "lq2": f64[ca + "lambda_q2"],
                "lk2": f64[ca + "lambda_k2"],
                "head_norm": f64[ca + "head_norm.weight"],
            }
        )
    return out


def _global_weights(f64: dict) -> dict:
    """The embedding, final norm and output matrix of a megatron-core state dict; no layers yet."""
    return {
        "embed": f64["embedding.word_embeddings.weight"],
        "final_norm": f64["decoder.final_layernorm.weight"],
        "output": f64["output_layer.weight"],
        "layers": [],
    }


def _dense_weights(f64: dict, p: str) -> dict:
    """Layer `p`'s norms, output projection and SwiGLU MLP (fc1 = [gate; up]), the same in V1 and V2."""
    fc1 = f64[p + "mlp.linear_fc1.weight"]
    poly = {}
    if p + "mlp.poly_norm.weight" in f64:
        poly = {"poly_w": f64[p + "mlp.poly_norm.weight"], "poly_b": f64[p + "mlp.poly_norm.bias"]}
    return {
        **poly,
        "input_norm": f64[p + "input_layernorm.weight"],
        "mlp_norm": f64[p + "pre_mlp_layernorm.weight"],
        "wo": f64[p + "self_attention.linear_proj.weight"],
        "gate": fc1[: fc1.shape[0] // 2],
        "up": fc1[fc1.shape[0] // 2 :],
        "down": f64[p + "mlp.linear_fc2.weight"],
    }


# ----------------------------------------------------------------------------------------------------
# DIFF V2 (unilm Diff-Transformer-V2): 2h query heads over ordinary GQA, per-token sigmoid lambda


def diff_v2_heads(q, k, v, lam, noise: int | None = None):
    """q: [h + n, s, d] query heads group by group [signal x r, noise] (n = `noise`, default h: the pairs
    2i, 2i + 1); k, v: [g, s, d]; lam: [s, h] -> [s, h * d]: signal head j = m r + i outputs
    attn[signal j] - lam_j attn[noise m]. A group's heads share KV head m // (n / g)."""
    heads, s, d = q.shape
    n = heads // 2 if noise is None else noise
    h, g = heads - n, k.shape[0]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    attn = []
    for j in range(heads):
        kv = j // (heads // g)  # contiguous groups: a group's signal and noise heads share K and V
        scores = (q[j] @ k[kv].T) / math.sqrt(d)
        attn.append(torch.softmax(scores.masked_fill(~causal, -math.inf), -1) @ v[kv])  # [s, d]
    r = h // n
    outs = []
    for m in range(n):
        for i in range(r):
            j = m * r + i
            outs.append(attn[m * (r + 1) + i] - lam[:, j : j + 1] * attn[m * (r + 1) + r])
    return torch.cat(outs, dim=-1)


def reference_logits_v2(tokens: torch.Tensor, w: dict, cfg: dict) -> torch.Tensor:
    """tokens [s] -> logits [s, vocab] of a DIFF V2 model with semantic weights `w` (`cfg["noise_heads"]`:
    grouped differential attention's noise heads, default h)."""
    x = w["embed"][tokens]  # [s, H]
    eps = cfg.get("eps", 1e-5)
    for lw in w["layers"]:
        hn = rmsnorm(x, lw["input_norm"], eps)
        q = rope(torch.einsum("sH,ndH->snd", hn, lw["wq"]), cfg["rotary_base"]).transpose(0, 1)
        k = rope(torch.einsum("sH,gdH->sgd", hn, lw["wk"]), cfg["rotary_base"]).transpose(0, 1)
        v = torch.einsum("sH,gdH->sgd", hn, lw["wv"]).transpose(0, 1)
        lam = torch.sigmoid(hn @ lw["wlambda"].T)  # [s, h]
        x = x + diff_v2_heads(q, k, v, lam, cfg.get("noise_heads")) @ lw["wo"].T
        hn = rmsnorm(x, lw["mlp_norm"], eps)
        x = x + mlp(hn, lw)
    return rmsnorm(x, w["final_norm"], eps) @ w["output"].T


def semantic_weights_v2_from_mcore(sd: dict, cfg: dict) -> dict:
    """Unpack a TP=1 DIFF V2 GPTModel state dict (local spec) into semantic float64 weights.

    Fused QKV rows per KV group: [r query heads of d, one key, one value] with r = (h + n) / g; query head
    j is row block j % r of group j // r.
    """
    h, g, d = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    n = cfg.get("noise_heads", h)
    # no detach: a test may differentiate the reference with respect to leaf copies of the state dict
    f64 = {k: v.to(torch.float64) for k, v in sd.items() if v is not None and hasattr(v, "dtype")}
    out = _global_weights(f64)
    for li in range(cfg["layers"]):
        p = f"decoder.layers.{li}."
        q, k, v = fused_qkv_blocks(f64[p + "self_attention.linear_qkv.weight"], h + n, g, d)
        out["layers"].append(
            {
                **_dense_weights(f64, p),
                "wq": q,
                "wk": k,
                "wv": v,
                "wlambda": f64[p + "self_attention.linear_lambda.weight"],
            }
        )
    return out
