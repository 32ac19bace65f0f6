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
    """q1,q2: [h, s, d]; k1,k2: [g, s, d]; v: [g, s, 2d] -> [s, h * 2d], one head at a time."""
    h, s, d = q1.shape
    g = k1.shape[0]
    lam = torch.exp(torch.dot(lq1, lk1)) - torch.exp(torch.dot(lq2, lk2)) + lam_init
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    outs = []
    for i in range(h):
        j = i // (h // g)
        s1 = (q1[i] @ k1[j].T) / math.sqrt(d)
        s2 = (q2[i] @ k2[j].T) / math.sqrt(d)
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
        lam0 = lambda_init(li) if cfg.get("lambda_init") is None else cfg["lambda_init"]
        attn = diff_heads(
            q1, q2, k1, k2, v, lw["lq1"], lw["lk1"], lw["lq2"], lw["lk2"], lw["head_norm"], lam0
        )
        x = x + attn @ lw["wo"].T
        hn = rmsnorm(x, lw["mlp_norm"], eps)
        x = x + (torch.nn.functional.silu(hn @ lw["gate"].T) * (hn @ lw["up"].T)) @ lw["down"].T
    return rmsnorm(x, w["final_norm"], eps) @ w["output"].T


def semantic_weights_from_mcore(sd: dict, cfg: dict) -> dict:
    """Unpack a TP=1 megatron-core GPTModel state dict (local spec) into semantic float64 weights.

    Fused QKV rows per query sub-group: [r query sub-heads of d, one key of d, one value of d], with
    r = 2h / 2g; sub-heads 2i/2i+1 are Q1/Q2 of head i, sub-groups 2j/2j+1 are K1/K2 (and V halves) of
    KV head j.
    """
    h, g, d = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    r = h // g  # query sub-heads per sub-group = 2h / 2g
    f64 = {k: v.detach().to(torch.float64) for k, v in sd.items() if v is not None and hasattr(v, "dtype")}
    out = _global_weights(f64)
    for li in range(cfg["layers"]):
        p = f"decoder.layers.{li}."
        qkv = f64[p + "self_attention.linear_qkv.weight"].view(2 * g, r + 2, d, -1)
        q_sub = qkv[:, :r].reshape(2 * h, d, -1)  # sub-head order
        k_sub, v_sub = qkv[:, r], qkv[:, r + 1]  # [2g, d, H]
        ca = p + "self_attention.core_attention."
        out["layers"].append(
            {
                **_dense_weights(f64, p),
                "wq1": q_sub[0::2],
                "wq2": q_sub[1::2],
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
    return {
        "input_norm": f64[p + "input_layernorm.weight"],
        "mlp_norm": f64[p + "pre_mlp_layernorm.weight"],
        "wo": f64[p + "self_attention.linear_proj.weight"],
        "gate": fc1[: fc1.shape[0] // 2],
        "up": fc1[fc1.shape[0] // 2 :],
        "down": f64[p + "mlp.linear_fc2.weight"],
    }


# ----------------------------------------------------------------------------------------------------
# DIFF V2 (unilm Diff-Transformer-V2): 2h query heads over ordinary GQA, per-token sigmoid lambda


def diff_v2_heads(q, k, v, lam):
    """q: [2h, s, d]; k, v: [g, s, d]; lam: [s, h] -> [s, h * d]: attn[2i] - lam_i attn[2i+1]."""
    n, s, d = q.shape
    g = k.shape[0]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    attn = []
    for j in range(n):
        kv = j // (n // g)  # contiguous groups: query heads 2i and 2i+1 share K and V
        scores = (q[j] @ k[kv].T) / math.sqrt(d)
        attn.append(torch.softmax(scores.masked_fill(~causal, -math.inf), -1) @ v[kv])  # [s, d]
    outs = [attn[2 * i] - lam[:, i : i + 1] * attn[2 * i + 1] for i in range(n // 2)]
    return torch.cat(outs, dim=-1)


def reference_logits_v2(tokens: torch.Tensor, w: dict, cfg: dict) -> torch.Tensor:
    """tokens [s] -> logits [s, vocab] of a DIFF V2 model with semantic weights `w`."""
    x = w["embed"][tokens]  # [s, H]
    eps = cfg.get("eps", 1e-5)
    for lw in w["layers"]:
        hn = rmsnorm(x, lw["input_norm"], eps)
        q = rope(torch.einsum("sH,ndH->snd", hn, lw["wq"]), cfg["rotary_base"]).transpose(0, 1)
        k = rope(torch.einsum("sH,gdH->sgd", hn, lw["wk"]), cfg["rotary_base"]).transpose(0, 1)
        v = torch.einsum("sH,gdH->sgd", hn, lw["wv"]).transpose(0, 1)
        lam = torch.sigmoid(hn @ lw["wlambda"].T)  # [s, h]
        x = x + diff_v2_heads(q, k, v, lam) @ lw["wo"].T
        hn = rmsnorm(x, lw["mlp_norm"], eps)
        x = x + (torch.nn.functional.silu(hn @ lw["gate"].T) * (hn @ lw["up"].T)) @ lw["down"].T
    return rmsnorm(x, w["final_norm"], eps) @ w["output"].T


def semantic_weights_v2_from_mcore(sd: dict, cfg: dict) -> dict:
    """Unpack a TP=1 DIFF V2 GPTModel state dict (local spec) into semantic float64 weights.

    Fused QKV rows per KV group: [r query heads of d, one key, one value] with r = 2h / g; query head j
    is row block j % r of group j // r.
    """
    h, g, d = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    r = 2 * h // g
    # no detach: a test may differentiate the reference with respect to leaf copies of the state dict
    f64 = {k: v.to(torch.float64) for k, v in sd.items() if v is not None and hasattr(v, "dtype")}
    out = _global_weights(f64)
    for li in range(cfg["layers"]):
        p = f"decoder.layers.{li}."
        qkv = f64[p + "self_attention.linear_qkv.weight"].view(g, r + 2, d, -1)
        out["layers"].append(
            {
                **_dense_weights(f64, p),
                "wq": qkv[:, :r].reshape(2 * h, d, -1),
                "wk": qkv[:, r],
                "wv": qkv[:, r + 1],
                "wlambda": f64[p + "self_attention.linear_lambda.weight"],
            }
        )
    return out
