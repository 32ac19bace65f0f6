"""Fused ops and their eager twins, one module per op (megatron-core's `fusions/`).

Which of them runs is chosen in `diffmeg.registry`, one floor up: the selector also names the DIFF
attention backends of `diffmeg.kernels`, which use `diff_combine` from here, so it stands above both.

- `rms_norm`: RMSNorm of the blocks and of DIFF's heads (eager, torch's `F.rms_norm`);
- `cross_entropy`: the training loss in chunks of tokens;
- `diff_combine`: DIFF's combination of the two maps (V1) and of head pairs (V2), V1's epilogue;
- `torchao_fp8`: FP8 linears on the local spec, a converter that rewrites the layer spec before the model
  is built (torchao's float8 matmul in megatron-core's parallel linears), and FP8's rules (`check_fp8`);
- `grad_accum`: weight gradients added into DDP's fp32 main_grad inside their GEMM
  (`--gradient-accumulation-fusion`), the functions megatron-core wants from apex, over torch's ops.

This face imports nothing, so importing one op never loads the others.
"""
