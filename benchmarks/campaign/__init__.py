"""The GPU validation and benchmark campaign: every figure of docs/benchmarks.md from a few commands.

Run from the repository's root:

    python3 -m benchmarks.campaign --prepare --wheels .whl                  # here, before each GPU command
    python3 -m benchmarks.campaign --lent-gpu --out DIR --wheels .whl       # GPU, < 510 s: env, train
    python3 -m benchmarks.campaign --lent-gpu --continue FILE --out DIR ... # GPU, < 180 s: what FILE lacks
    python3 -m benchmarks.campaign --plan                                   # the comparisons, device time
    python3 -m benchmarks.campaign --phase env,tests,kernels --out DIR --wheels .whl  # the other phases
    python3 -m benchmarks.campaign --smoke --device cpu --out /tmp/campaign # CPU: all, tiny

Phases (docs/gpu.md says what each measures and how to read it), one module each:
  env      (env.py) GPU, memory, versions, measured bf16 matmul TFLOP/s (the roof for MFU); always runs
  tests    (gpu_tests.py) `pytest -m gpu` on GPU_TEST_PATHS; failures are recorded, not fatal
  kernels  (kernels.py) forward+backward time of every DIFF V1 attention backend and the baseline's flash
           attention (3B head layout), each DIFF path checked against float64
  train    (train.py) tokens/s and MFU of a 3B-wide model cut to what fits: each model's defaults and fast
           path, DIFF against the Transformer, FP8, DIFF's attention candidates, each lever's share, as
           comparisons of two variants in worker processes of their own whose timed windows alternate
           (train_plan.py the plan, worker.py the workers, interleave.py the timer, estimate.py the
           device time)
  memory   (memory.py, runs.py) the memory plan against torch.cuda.max_memory_allocated (recompute
           none/selective/full), and a 50-iteration bf16 run per small preset with save, exact resume and
           generation (gpu_train_run)

Around them: plan.py (sizes and budgets), runner.py (the parent: one child process per phase, the results
file, the exit status), procs.py (child-process plumbing), part.py (a phase's results, saved after every
row), resume.py and merge.py (a command continuing an earlier file), figures.py (headline figures from
rows), install.py (wheels), summary.py (the printed table) and schema.py (the results file, as
benchmarks/report.py reads it). Each phase runs in its own process (a CUDA fault in one cannot take the
others down) under a time budget; the whole command ends within --budget seconds. Writes
DIR/campaign-<device>-<time>.json (rewritten whole whenever a phase saved rows, so a command killed at its
limit still leaves what it measured) and a log beside it, and prints a short table.
benchmarks/report.py turns the JSON files kept under benchmarks/results/ into docs/benchmarks.md's GPU
tables.
"""
