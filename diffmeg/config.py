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


def megatron_head_counts(
    heads: int, kv_heads: int, diff_attention: bool, diff_version: int = 1
) -> tuple[int, int]:
    """(num_attention_heads, num_query_groups) for megatron-core from h output heads and g KV heads."""
    if not diff_attention:
        return heads, kv_heads
    return (2 * heads, 2 * kv_heads) if diff_version == 1 else (2 * heads, kv_heads)


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
    query_heads, groups = megatron_head_counts(heads, kv_heads, model.diff_attention, model.diff_version)
    v2 = model.diff_attention and model.diff_version == 2
    q, kv = query_heads * d, 2 * groups * d
    out = heads * d if v2 else q  # V2 projects the h combined heads
    # Split over tensor-parallel ranks: the attention and MLP matrices, V2's lambda projection; held whole
    # by each: the two RMSNorms, V1's lambda vectors (4d) and head norm (2d).
    split = H * (q + kv) + out * H + (H * heads if v2 else 0) + 3 * H * F
    whole = 2 * H + (6 * d if model.diff_attention and not v2 else 0)
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

    lambda_init: str | float = "exp"
    """`"exp"`: the paper's layer-wise schedule from the global layer number; a float: a constant
    lambda_init for every layer (the paper's ablation). Must lie in [0, 1)."""

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

    def _paired_heads(self, needs: str) -> int:
        """h: megatron-core's `num_attention_heads` counts 2h query (sub-)heads in both DIFF versions."""
        if self.num_attention_heads % 2:
            raise DiffmegError(f"{needs}, got num_attention_heads={self.num_attention_heads}")
        return self.num_attention_heads // 2

    def _validate_diff(self) -> None:
        tp = self.tensor_model_parallel_size
        heads = self._paired_heads(
            "differential attention needs an even number of sub-heads (2 x DIFF heads)"
        )
        if heads % tp:
            raise DiffmegError(
                f"{heads} differential heads cannot be split over tensor-model-parallel-size {tp}: "
                f"choose a TP size that divides the head count"
            )
        groups = self.num_query_groups if self.num_query_groups is not None else self.num_attention_heads
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
            if self.lambda_init != "exp":
                try:
                    self.lambda_init = float(self.lambda_init)
                except ValueError:
                    raise DiffmegError(
                        f"lambda_init must be 'exp' or a number in [0, 1), got {self.lambda_init!r}"
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
            heads=heads,
            kv_heads=groups // 2,
            tp=tp,
            attention_dropout=self.attention_dropout,
        )

    def _validate_diff_v2(self) -> None:
        tp = self.tensor_model_parallel_size
        heads = self._paired_heads("DIFF V2 needs an even number of query heads (2 x output heads)")
        groups = self.num_query_groups if self.num_query_groups is not None else heads
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

    @property
    def num_diff_heads(self) -> int:
        """Number of differential heads h (each owns two sub-heads of d and a V of 2d)."""
        return self.num_attention_heads // 2

    @property
    def num_diff_kv_heads(self) -> int:
        """Number of differential KV heads g (each a K1/K2 pair plus a V of 2d)."""
        return self.num_query_groups // 2

    def lambda_init_at(self, layer_number: int) -> float:
        """lambda_init for megatron-core's global, 1-based `layer_number` (identical on every PP stage)."""
        if isinstance(self.lambda_init, str):
            return lambda_init_for_layer(layer_number - 1)
        return float(self.lambda_init)
