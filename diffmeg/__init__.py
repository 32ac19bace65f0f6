"""diffmeg: Megatron-style pretraining of the Differential Transformer on megatron-core."""

import warnings

__version__ = "0.1.0"

# megatron-core announces at import, once per module, that the optional GPU extras are absent; on a
# CPU machine that is expected, and the five lines would bury every one-line error we print.
warnings.filterwarnings(
    "ignore", message=r".*(Transformer Engine|Apex).* (is|are) not installed", category=UserWarning
)
