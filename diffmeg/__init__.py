"""diffmeg: Megatron-style pretraining of the Differential Transformer on megatron-core."""

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
