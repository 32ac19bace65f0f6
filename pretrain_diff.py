"""Pretrain a Differential Transformer (or its FLOP-matched Transformer baseline) on megatron-core.

python pretrain_diff.py --model diff-tiny                       # CPU, embedded corpus
torchrun --nproc_per_node 8 pretrain_diff.py --model diff-3b --data-path ... --bf16
python pretrain_diff.py --model diff-3b --dry-run               # resolved config as JSON
"""

from __future__ import annotations

import os
import sys
import time

from diffmeg.cli import quiet_third_party_warnings

quiet_third_party_warnings()  # before megatron-core's imports below, which warn as they load

from diffmeg.errors import cli_errors  # noqa: E402
from diffmeg.training.arguments import resolve_args  # noqa: E402
from diffmeg.training.dry_run import dry_run  # noqa: E402


@cli_errors
def main(argv: list[str] | None = None) -> int:
    """Arguments -> runtime setup -> Trainer. Exit status 0, 2 (one-line error) or 130 (Ctrl-C)."""
    args = resolve_args(argv)
    if args.dry_run:
        return dry_run(args)
    from diffmeg import runtime
    from diffmeg.run_config import RunConfig
    from diffmeg.training.trainer import Trainer

    runtime.setup()
    if args.deterministic_mode:
        runtime.make_deterministic()
    start = time.perf_counter()
    try:
        # Inside train() Ctrl-C saves and stops (a second one exits at once); before it, this catches it.
        result = Trainer(RunConfig.from_args(args)).train()
        if int(os.environ.get("RANK", "0")) == int(os.environ.get("WORLD_SIZE", "1")) - 1:  # logging rank
            from diffmeg.training.logger import end_summary

            print(end_summary(args, result, time.perf_counter() - start), flush=True)
    except KeyboardInterrupt:
        print("error: interrupted (Ctrl-C) before training started", file=sys.stderr, flush=True)
        return 130
    finally:
        runtime.teardown()
    if args.export_hf_at_end is not None and int(os.environ.get("RANK", "0")) == 0:
        from diffmeg.conversion.hf_export import export_at_end  # every rank's save is complete by now

        export_at_end(args.save, args.export_hf_at_end, result["iteration"], result["exit_code"] == 130)
    return result["exit_code"]


if __name__ == "__main__":  # importable without side effects (tests import main)
    sys.exit(main())
