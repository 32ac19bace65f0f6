"""Model configuration: megatron-core's `TransformerConfig` plus the Differential Transformer fields.

Head bookkeeping (the one place it is defined, `megatron_head_counts`; the parameter count built on it,
`count_parameters`): the command line counts h differential (output) heads and g KV heads for every
architecture; megatron-core's `SelfAttention` sees
- DIFF V1 (the paper): `num_attention_heads = 2h` *sub-heads* of `kv_channels = d`. Sub-heads `2i` and
  `2i+1` are Q1/Q2 of differential head `i`, and V of head `i` is sub-heads `2i, 2i+1` of V concatenated
  (width 2d). GQA works in KV *pairs*: `num_query_groups = 2g` sub-groups, differential KV head `j` is
  sub-groups `2j, 2j+1`. So the projections have exactly the shapes of a Transformer with 2h heads of d.
- DIFF V2: `num_attention_heads = 2h` query heads of d over ordinary GQA with `num_query_groups = g`
  (query head j uses KV head j // (2h/g), so heads 2i and 2i+1 share K and V); head i's output is
  `attn[2i] - sigmoid(lambda_proj(x))_i attn[2i+1]`, h heads of d into the output projection.
- the Transformer baseline: h heads of d, g KV heads, as given.

Grouped differential attention (GDA, Motif's; `--num-noise-heads n`, n dividing h): the h signal heads
share n noise heads, r = h / n signal heads a noise head, laid out group by group `[signal x r, noise]`,
so megatron-core sees h + n query (sub-)heads; n = h (the default) is the 1:1 layout above, unchanged.
V1 keeps its 2g sub-groups (a K1/K2 pair and a V of 2d per KV head); V2 its g KV heads.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

from megatron.core.transformer.transformer_config import TransformerConfig

from diffmeg import registry
from diffmeg.errors import DiffmegError
from diffmeg.parallel.validation import validate_cp
from diffmeg.run_config import ModelConfig

DIFF_VERSIONS = (1, 2)
MLP_ACTIVATIONS = ("swiglu", "poly_norm")
LAMBDA_INIT_SCHEDULES = {"exp": 1, "motif": 2}
"""The layer-wise lambda_init schedules, `0.8 - 0.6 exp(-0.3 (l - k))` for 1-based layer l, by the k each
subtracts: the paper's l - 1, Motif's checkpoints' layer_idx - 1 with a 0-based layer_idx = l - 1."""


def megatron_head_counts(
    heads: int, kv_heads: int, diff_attention: bool, diff_version: int = 1, noise_heads: int | None = None
) -> tuple[int, int]:
    """(num_attention_heads, num_query_groups) for megatron-core from h output heads, g KV heads and n
    noise heads (None: h, the 1:1 DIFF)."""
    if not diff_attention:
        return heads, kv_heads
    queries = heads + (heads if noise_heads is None else noise_heads)
    return (queries, 2 * kv_heads) if diff_version == 1 else (queries, kv_heads)


def query_heads_per_subgroup(query_heads: int, groups: int) -> list[int]:
    """How many of `query_heads` query (sub-)heads each of megatron-core's `groups` query groups holds in
    the fused QKV weight: megatron-core's `query_heads / groups` where that divides, else spread as evenly
    as it goes (group m holds heads floor(m q / g) to floor((m + 1) q / g)). DIFF V1's GDA needs the
    second form: Motif-2-12.7B's 40 query heads over 16 K/V sub-groups. A tensor-parallel rank holding
    whole groups sees the same pattern on its own heads."""
    return [(m + 1) * query_heads // groups - m * query_heads // groups for m in range(groups)]


def count_parameters(model: ModelConfig, tensor_parallel: int = 1, pipeline_parallel: int = 1) -> int:
    """Exact parameter count of the GPT model `model` describes (heads as on the command line: h output
    heads, g KV heads); with `tensor_parallel` or `pipeline_parallel` above 1, what one tensor-parallel rank
    of the largest pipeline stage holds. A tied output layer (`--tie-embeddings-and-output-weights`) is
    counted once in the whole model; under pipeline parallelism the last stage holds megatron-core's copy
    of the embedding as its output layer. The one formula of the dry run, the memory plan, the run's summary
    line and a checkpoint's size."""
    d, H, F, V = model.kv_channels, model.hidden_size, model.ffn_hidden_size, model.vocab_size
    heads = model.num_attention_heads
    kv_heads = heads if model.num_query_groups is None else model.num_query_groups
    query_heads, groups = megatron_head_counts(
        heads, kv_heads, model.diff_attention, model.diff_version, model.num_noise_heads
    )
    v2 = model.diff_attention and model.diff_version == 2
    q, kv = query_heads * d, 2 * groups * d
    # the combined heads into the output projection: h of d (V2), h of 2d (V1), the baseline's h of d
    out = heads * d * (2 if model.diff_attention and not v2 else 1)
    # Split over tensor-parallel ranks: the attention and MLP matrices, V2's lambda projection; held whole
    # by each: the two RMSNorms, V1's lambda vectors (4d) and head norm (2d).
    split = H * (q + kv) + out * H + (H * heads if v2 else 0) + 3 * H * F
    whole = 2 * H + (6 * d if model.diff_attention and not v2 else 0)
    whole += 4 if model.mlp_activation == "poly_norm" else 0  # PolyNorm's weights [3] and bias [1]
    layers = model.num_layers // pipeline_parallel * (split // tensor_parallel + whole)
    embedding = V * H // tensor_parallel
    if pipeline_parallel > 1:  # the last stage: its layers, output layer and final norm
        return layers + embedding + H
    output_layers = 1 if model.tie_embeddings_and_output_weights else 2
    return layers + output_layers * embedding + H  # + the final norm


def lambda_init_for_layer(layer_index: int) -> float:
    """The paper's depth schedule `0.8 - 0.6 * exp(-0.3 * (l - 1))` for 0-based `layer_index = l - 1`."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_index)


@dataclass
class DiffTransformerConfig(TransformerConfig):
    """`TransformerConfig` for DIFF (or, with `diff_attention=False`, the FLOP-matched baseline)."""

    diff_attention: bool = True
    """Use differential attention. False builds the plain Transformer baseline from the same code."""

    diff_version: int = 1
    """1: the paper's differential attention (two maps over V of 2d, lambda reparameterisation, head
    RMSNorm); 2: DIFF V2 (2h query heads over ordinary GQA attention, a per-token sigmoid lambda from
    `lambda_proj`, no head norm). The V1-only fields below are ignored by V2."""

    num_noise_heads: int | None = None
    """n: noise heads of grouped differential attention (GDA): the h signal heads form n groups of
    r = h / n, laid out `[signal x r, noise]` in megatron-core's `num_attention_heads = h + n` query
    (sub-)heads, each group's signal heads subtracting its one noise map. None: as many as signal heads
    (the paper's and DIFF V2's 1:1 pairs, megatron-core's `num_attention_heads = 2h`)."""

    lambda_init: str | float = "exp"
    """`"exp"`: the paper's layer-wise schedule from the global layer number, `0.8 - 0.6 exp(-0.3 (l - 1))`
    for layer l = 1, 2, ...; `"motif"`: Motif's checkpoints' `0.8 - 0.6 exp(-0.3 (i - 1))` with i = l - 1
    counted from 0 (one layer later in the schedule: -0.01 for the first layer); a float: a constant
    lambda_init for every layer (the paper's ablation), in [0, 1)."""

    mlp_activation: str = "swiglu"
    """The gated MLP's activation: `"swiglu"` (megatron-core's, every preset's) or `"poly_norm"` (Motif's
    PolyNorm, `diffmeg.mlp.PolyNormMLP`)."""

    lambda_std: float = 0.1
    """Std of the normal init of the four lambda reparameterization vectors (lq1, lk1, lq2, lk2)."""

    head_norm_eps: float = 1e-5
    """Epsilon of the per-head RMSNorm applied to each differential head's output (width 2d)."""

    diff_attn_backend: str = "auto"
    """Differential attention backend (`--diff-attn-backend`), a name of `diffmeg.registry`'s
    `diff_attention` slot: reference (plain math), sdpa (torch) or one of its paths, or auto."""

    norm_impl: str = "auto"
    """RMSNorm implementation (`--norm-impl`), a name of `diffmeg.registry`'s `norm` slot of the local
    family: the local spec's block and final norms and DIFF V1's head norm. auto: the spec's own (the
    Transformer Engine spec keeps TE's norms whatever this says, bar the head norm)."""

    sdpa_backend: str = "auto"
    """Which kernel torch's SDPA tries first in every core attention (`--sdpa-backend`), a name of
    `diffmeg.registry`'s `sdpa_kernel` slot: auto (torch's own order), cudnn, flash, efficient (GPU
    kernels first, the others behind) or math."""

    cp_comm_type: str | list[str] | None = None
    """megatron-core's field, with one more value for DIFF: `ulysses` (None means it) shards heads with
    diffmeg's all-to-all around any backend; `p2p`, `all_gather`, `a2a` run both maps through
    megatron-core's TEDotProductAttention with its own CP (`diffmeg.parallel.te_attention`; needs TE). The
    baseline passes the value to megatron-core as is (None = p2p)."""

    share_embeddings_and_output_weights: bool = False
    """Tie the output layer to the word embedding (one [vocab, hidden] matrix, megatron-core's GPTModel
    option; `--tie-embeddings-and-output-weights`). False: the output layer is a matrix of its own, the
    default of every preset and of args.json files that predate the flag."""

    cross_entropy_chunk_size: int | None = None
    """Tokens per chunk of the training loss's output projection and cross entropy
    (`diffmeg.fusions.cross_entropy`): the whole logits are never held, each chunk's are recomputed in
    backward. None: megatron-core's loss over the whole logits. Only the loss changes: logits (no labels)
    and the parameters are the same either way."""

    fp8_emulate: bool = False
    """With `fp8` on the local spec (torchao's FP8 linears): cast to FP8 as on a GPU but multiply in high
    precision, so FP8's numerics run on a CPU or a GPU without FP8 matmuls (tests; no speed-up)."""

    def __post_init__(self) -> None:
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise DiffmegError(
                f"mlp_activation must be one of {', '.join(MLP_ACTIVATIONS)}, got {self.mlp_activation!r}"
            )
        self._validate_impls()
        self._validate_loss()
        if self.diff_attention and self.diff_version not in DIFF_VERSIONS:
            raise DiffmegError(f"diff_version must be 1 or 2, got {self.diff_version!r}")
        if self.diff_attention and self.diff_version == 2:
            self._validate_diff_v2()
        elif self.diff_attention:
            self._validate_diff()
        else:
            validate_cp(
                cp_size=self.context_parallel_size,
                comm_type=self.cp_comm_type,
                diff_attention=False,
                heads=self.num_attention_heads,
                kv_heads=self.num_query_groups or self.num_attention_heads,
                tp=self.tensor_model_parallel_size,
            )
        super().__post_init__()

    def _validate_impls(self) -> None:
        registry.check_name("norm", self.norm_impl)
        registry.check_name("sdpa_kernel", self.sdpa_backend)

    def sdpa_preference(self) -> Callable[[], contextlib.AbstractContextManager]:
        """The context every core attention enters around its SDPA calls: `sdpa_backend`'s row."""
        return registry.entry("sdpa_kernel", self.sdpa_backend).load()

    def _validate_loss(self) -> None:
        size = self.cross_entropy_chunk_size
        if size is None:
            self._validate_fused_loss()
            return
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise DiffmegError(f"cross_entropy_chunk_size must be a number of tokens >= 1, got {size!r}")
        for field, what in (
            ("cross_entropy_loss_fusion", "megatron-core's fused cross entropy"),
            ("defer_embedding_wgrad_compute", "deferred output-layer weight gradients"),
            ("mtp_num_layers", "multi-token prediction"),
        ):
            if getattr(self, field):
                raise DiffmegError(f"the chunked cross entropy does not combine with {what} ({field})")

    def _validate_fused_loss(self) -> None:
        if self.cross_entropy_loss_fusion and self.cross_entropy_fusion_impl == "native" and not self.bf16:
            raise DiffmegError(
                "megatron-core's native fused cross entropy returns bf16 gradients: use it with --bf16, "
                "or leave out --cross-entropy-loss-fusion"
            )

    def _signal_and_noise_heads(self, needs: str) -> tuple[int, int]:
        """(h, n): megatron-core's `num_attention_heads` counts the h signal and n noise query (sub-)heads of
        both DIFF versions (2h without `num_noise_heads`); h must be a multiple of n."""
        queries, n = self.num_attention_heads, self.num_noise_heads
        if n is None:
            if queries % 2:
                raise DiffmegError(f"{needs}, got num_attention_heads={queries}")
            return queries // 2, queries // 2
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n < queries or (queries - n) % n:
            raise DiffmegError(
                f"num_noise_heads={n} must divide the {queries - n if isinstance(n, int) else '?'} signal "
                f"heads (num_attention_heads {queries} counts signal + noise query heads)"
            )
        return queries - n, n

    def _validate_groups(self, noise: int, kv_heads: int, tp: int, kind: str) -> None:
        """GDA (n < h): a group of signal heads and their noise head stays on one tensor-parallel rank and
        shares one KV head. (With n = h these are the pair checks that follow.)"""
        if noise % tp:
            raise DiffmegError(
                f"{noise} noise heads cannot be split over tensor-model-parallel-size {tp}: each rank holds "
                f"whole groups of signal heads and their noise head; use a TP size dividing the noise heads"
            )
        if noise % kv_heads:
            raise DiffmegError(
                f"{noise} noise heads are not a multiple of the {kv_heads} {kind}: a group's signal and "
                f"noise heads must share one KV head; choose --num-noise-heads a multiple of "
                f"--num-query-groups"
            )

    def _validate_diff(self) -> None:
        tp = self.tensor_model_parallel_size
        heads, noise = self._signal_and_noise_heads(
            "differential attention needs an even number of sub-heads (2 x DIFF heads)"
        )
        if self.num_query_groups is None:  # a K1/K2 pair per noise head (megatron-core's 2h for the 1:1 DIFF)
            self.num_query_groups = 2 * noise
        groups = self.num_query_groups
        if noise != heads and groups % 2 == 0:
            self._validate_groups(noise, groups // 2, tp, "differential KV heads")
        if heads % tp:
            raise DiffmegError(
                f"{heads} differential heads cannot be split over tensor-model-parallel-size {tp}: "
                f"choose a TP size that divides the head count"
            )
        if groups % 2 or (groups // 2) == 0 or heads % (groups // 2):
            raise DiffmegError(
                f"num_query_groups={groups // 2 if groups % 2 == 0 else groups} differential KV heads must "
                f"divide the {heads} differential heads"
            )
        if (groups // 2) % tp:
            raise DiffmegError(
                f"{groups // 2} differential KV heads cannot be split over tensor-model-parallel-size {tp}: "
                f"each rank needs whole K1/K2 pairs; use a TP size dividing the KV head count"
            )
        if isinstance(self.lambda_init, str):
            if self.lambda_init not in LAMBDA_INIT_SCHEDULES:
                try:
                    self.lambda_init = float(self.lambda_init)
                except ValueError:
                    raise DiffmegError(
                        f"lambda_init must be 'exp', 'motif' or a number in [0, 1), got {self.lambda_init!r}"
                    ) from None
        if not isinstance(self.lambda_init, str) and not 0.0 <= self.lambda_init < 1.0:
            raise DiffmegError(f"constant lambda_init must lie in [0, 1), got {self.lambda_init}")
        if self.lambda_std < 0:
            raise DiffmegError(f"lambda_std must be >= 0, got {self.lambda_std}")
        if self.head_norm_eps <= 0:
            raise DiffmegError(f"head_norm_eps must be > 0, got {self.head_norm_eps}")
        registry.check_name("diff_attention", self.diff_attn_backend)
        validate_cp(
            cp_size=self.context_parallel_size,
            comm_type=self.cp_comm_type,
            diff_attention=True,
            heads=noise,  # whole groups of signal heads and their noise head (n = h: differential heads)
            kv_heads=groups // 2,
            tp=tp,
            attention_dropout=self.attention_dropout,
        )

    def _validate_diff_v2(self) -> None:
        tp = self.tensor_model_parallel_size
        heads, noise = self._signal_and_noise_heads(
            "DIFF V2 needs an even number of query heads (2 x output heads)"
        )
        if self.num_query_groups is None:  # a KV head per noise head: each head pair its own
            self.num_query_groups = noise
        groups = self.num_query_groups
        if noise != heads and groups >= 1:
            self._validate_groups(noise, groups, tp, "KV heads")
        if groups < 1 or heads % groups:
            raise DiffmegError(f"{groups} KV heads must divide the {heads} DIFF V2 heads")
        if heads % tp or groups % tp:
            raise DiffmegError(
                f"DIFF V2 with {heads} heads and {groups} KV heads cannot be split over "
                f"tensor-model-parallel-size {tp}: choose a TP size dividing both (each rank keeps whole "
                f"query-head pairs and their KV heads)"
            )
        validate_cp(
            cp_size=self.context_parallel_size,
            comm_type=self.cp_comm_type,
            diff_attention=True,
            heads=self.num_attention_heads,
            kv_heads=groups,
            tp=tp,
            unit="query heads",
        )
        if self.context_parallel_size > 1 and noise != heads:
            # Ulysses shards query heads: a shard must hold whole groups of signal heads and their noise head
            validate_cp(
                cp_size=self.context_parallel_size,
                comm_type=self.cp_comm_type,
                diff_attention=True,
                heads=noise,
                kv_heads=groups,
                tp=tp,
                unit="noise groups",
            )

    @property
    def num_diff_heads(self) -> int:
        """Number of differential (signal, output) heads h."""
        return self.num_attention_heads - self.noise_heads

    @property
    def noise_heads(self) -> int:
        """n: noise heads (h for the 1:1 DIFF, where `num_noise_heads` is None)."""
        return self.num_attention_heads // 2 if self.num_noise_heads is None else self.num_noise_heads

    @property
    def noise_ratio(self) -> int:
        """r = h / n: signal heads per noise head (1 for the 1:1 DIFF)."""
        return self.num_diff_heads // self.noise_heads

    @property
    def num_diff_kv_heads(self) -> int:
        """Number of differential KV heads g (each a K1/K2 pair plus a V of 2d)."""
        return self.num_query_groups // 2

    def lambda_init_at(self, layer_number: int) -> float:
        """lambda_init for megatron-core's global, 1-based `layer_number` (identical on every PP stage)."""
        if isinstance(self.lambda_init, str):
            return lambda_init_for_layer(layer_number - LAMBDA_INIT_SCHEDULES[self.lambda_init])
        return float(self.lambda_init)
