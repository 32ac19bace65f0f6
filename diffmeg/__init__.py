"""diffmeg: Megatron-style pretraining of the Differential Transformer on megatron-core."""

import functools
import importlib.abc
import importlib.machinery
import logging
import sys
import warnings

__version__ = "0.1.0"

# megatron-core announces at import, once per module, that the optional GPU extras are absent; on a
# CPU machine that is expected, and the five lines would bury every one-line error we print.
warnings.filterwarnings(
    "ignore", message=r".*(Transformer Engine|Apex).* (is|are) not installed", category=UserWarning
)


class _TorchaoImportNoise(logging.Filter):
    """The lines torchao writes when it is imported (transformers imports it with its model classes, so
    every Hugging Face conversion, export check and evaluation did) that say nothing about the run:

    - "Failed to load .../torchao/_C*.so": PyPI's torchao wheels (every version) carry CUDA extensions
      (MX FP8, CUTLASS kernels), which a CPU build of torch cannot load; torchao works without them (its
      float8 training, the FP8 emulation our CPU tests run). Dropped only when this torch has no CUDA: on
      a CUDA torch the line is a real mismatch, and stays.
    - torch's deprecation of `register_constant()` on Enum subclasses, which torchao calls for its own
      enums: a note to torchao's developers, dropped for torchao's enums only.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "torchao":
            torch = sys.modules.get("torch")
            cpu_torch = torch is not None and getattr(torch.version, "cuda", None) is None
            message = str(record.msg)
            return not (cpu_torch and message.startswith("Failed to load") and ".so" in message)
        args = record.args if isinstance(record.args, tuple) else ()
        enum = args[0] if args else None
        return not (
            "register_constant()" in str(record.msg)
            and isinstance(enum, type)
            and enum.__module__.split(".")[0] == "torchao"
        )


# Filters on the two loggers themselves, set before anything imports torchao: they drop these records and
# only these, whoever configures logging later (torch's own handlers included).
for _logger in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_logger).addFilter(_TorchaoImportNoise())
del _logger


def _compile_on_first_call(fn):
    """`torch.compile(fn)`, called when `fn` is first called rather than when it is defined."""
    import torch

    compiled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if torch.compiler.is_compiling():  # inside an enclosing compiled region: traced inline
            return fn(*args, **kwargs)
        if compiled is None:
            compiled = torch.compile(fn)
        return compiled(*args, **kwargs)

    call._torchdynamo_inline = fn  # what torch.compile's own wrapper carries: Dynamo inlines `fn`
    return call


class _FusionsCompiledOnFirstCall(importlib.abc.MetaPathFinder):
    """megatron-core decorates ~40 fusion functions with `megatron.core.jit.jit_fuser`, which is
    `torch.compile`; calling torch.compile imports TorchDynamo and Inductor on the spot. That was ~4 s of
    every process's start on 2 cores (`import megatron.core.models.gpt` 8.4 s, 4.1 s without it), paid by
    every rank, tool and test, though a CPU run never calls these functions and a GPU run compiles each
    at its first call anyway. This finder hands megatron.core.jit a `jit_fuser` that calls torch.compile
    at that first call: the same compiled function from the same call on (tests/test_package.py)."""

    def find_spec(self, name, path=None, target=None):
        if name != "megatron.core.jit":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            if module.jit_fuser is module.torch.compile:
                module.jit_fuser = _compile_on_first_call

        spec.loader.exec_module = exec_module
        return spec


if "megatron.core.jit" not in sys.modules:
    sys.meta_path.insert(0, _FusionsCompiledOnFirstCall())
