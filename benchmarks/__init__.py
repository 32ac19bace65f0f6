"""Benchmarks and the GPU campaign (run from the repository's root; never imported by diffmeg).

A regular package, so `python3 -m benchmarks.campaign` and `from benchmarks import ...` find this folder
even where another installed distribution ships a top-level `benchmarks` package.
"""


def model_flags(flags: list[str], cpu_flags: list[str]) -> tuple[list[str], bool]:
    """(pretrain_diff.py flags of the model a script times, whether it runs on the CPU), after diffmeg's
    process setup. On a CPU the flags default to `cpu_flags` and torch uses one thread per process (the
    host's other cores stay free for the ranks and writer processes beside it); a GPU has no default."""
    import torch

    from diffmeg import runtime

    runtime.setup()
    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        torch.set_num_threads(1)
    flags = flags or (cpu_flags if on_cpu else [])
    if not flags:
        raise SystemExit("give the pretrain_diff.py flags of the model to time (no default on GPU)")
    return flags, on_cpu
