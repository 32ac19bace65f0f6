"""The GPU validation and benchmark campaign: every figure of docs/benchmarks.md from a few commands.

Run from the repository's root:

    python3 -m benchmarks.campaign --phase env,tests,kernels --out DIR --wheels .whl   # GPU, < 9 min
    python3 -m benchmarks.campaign --phase train --out DIR --wheels .whl               # GPU, < 9 min
    python3 -m benchmarks.campaign --phase train --continue FILE --out DIR ...         # the runs FILE lacks
    python3 -m benchmarks.campaign --plan                                              # train runs, counted
    python3 -m benchmarks.campaign --phase memory --out DIR --wheels .whl              # GPU, < 9 min
    python3 -m benchmarks.campaign --smoke --device cpu --out /tmp/campaign            # CPU: all, tiny

Phases (docs/gpu.md says what each measures and how to read it), one module each:
  env      (env.py) GPU, memory, versions, measured bf16 matmul TFLOP/s (the roof for MFU); always runs
  tests    (gpu_tests.py) `pytest -m gpu` on GPU_TEST_PATHS; failures are recorded, not fatal
  kernels  (kernels.py) forward+backward time of every DIFF V1 attention backend and the baseline's flash
           attention (3B head layout), each DIFF path checked against float64
  train    (train.py) tokens/s and MFU of a 3B-wide model cut to what fits, DIFF per backend vs the
           FLOP-matched Transformer on the same model code, at 4096 and 2048
  memory   (memory.py, runs.py) the memory plan against torch.cuda.max_memory_allocated (recompute
           none/selective/full), and a 50-iteration bf16 run per small preset with save, exact resume and
           generation (gpu_train_run)

Around them: plan.py (sizes and budgets), runner.py (the parent: one child process per phase, the results
file, the exit status), procs.py (child-process plumbing), part.py (a phase's results, saved after every
row), resume.py (a train phase continuing an earlier file), figures.py (headline figures from rows),
install.py (wheels), summary.py (the printed table) and schema.py (the results file, as benchmarks/report.py
reads it). Each phase runs in its own process (a CUDA fault in one cannot take the others down) under a time
budget; the whole command ends within --budget seconds. Writes DIR/campaign-<device>-<time>.json and a log
beside it, and prints a short table. benchmarks/report.py turns the JSON files kept under
benchmarks/results/ into docs/benchmarks.md's GPU tables.
"""
