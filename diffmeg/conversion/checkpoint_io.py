"""Reading and writing the two checkpoint formats, streaming (with mcore_writer.py, safetensors_io.py and
output_dir.py, the only modules here that do I/O).

- megatron-core dist checkpoints are layout-free: every tensor is stored under one global key with its
  full shape (layers stacked on a leading axis), whatever TP/PP wrote it. `McoreCheckpointReader`
  loads exactly one layer's slices (or one tensor outside the layers) at a time, in the checkpoint's own
  dtype. Writing is `mcore_writer.StreamingCheckpointWriter`, one part at a time.
- Hugging Face folders (DiffLlama or Llama): read tensor by tensor with plain file reads
  (`HFCheckpointReader`, safetensors_io.py); written shard by shard as tensors arrive
  (safetensors_io.SafetensorsShardWriter).
- Outputs are written through `output_dir.atomic_output_dir` (a failed conversion never leaves a
  half-written output behind, and `--overwrite` replaces only what a conversion writes).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import shutil
import warnings
from collections.abc import Iterable, Iterator

import torch

from diffmeg.checkpoints import damaged_checkpoint_message, damaged_file, first_line, read_checkpoint_args
from diffmeg.conversion.layout import Diff2Layout, DiffLayout, LlamaLayout, ModelLayout, MotifLayout
from diffmeg.conversion.safetensors_io import INDEX_FILE, SafetensorsFile
from diffmeg.errors import DiffmegError
from diffmeg.storage import write_json

# megatron-core stores the local spec's layer norms under the names of Transformer Engine's fused
# layers (so checkpoints move between the local and TE specs); every other key is the state-dict key.
_CKPT_LAYER_KEYS = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
CKPT_LAYER_PREFIX = "decoder.layers."
"""Prefix of layer tensors both in the state dict (then `N.`) and in the checkpoint (layers stacked)."""


def checkpoint_key(local_key: str) -> str:
    """The dist-checkpoint key of a layer tensor (`local_key` is relative to `decoder.layers.N.`)."""
    return CKPT_LAYER_PREFIX + _CKPT_LAYER_KEYS.get(local_key, local_key)


def _chunk_planner(offsets: dict[str, tuple[int, ...]]):
    """A DCP load planner that reads, for each requested key, the chunk of the stored global tensor
    starting at `offsets[key]` with the destination tensor's size (e.g. one layer of a stacked key).

    megatron-core's own loader cannot read part of a tensor in a world of one process (it marks the
    other chunks as owned by "the next rank", which is itself), so the chunks are planned here.
    """
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class Planner(DefaultLoadPlanner):
        def create_local_plan(self) -> LoadPlan:
            items = []
            for key, tensor in self.state_dict.items():
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets[key]), sizes=tensor.size())
                items += create_read_items_for_chunk_list(
                    key, self.metadata.state_dict_metadata[key], [chunk]
                )
            return LoadPlan(items)

        def lookup_tensor(self, index) -> torch.Tensor:
            return self.state_dict[index.fqn]  # our tensor is the chunk (the default looks up whole tensors)

    return Planner(flatten_state_dict=False, flatten_sharded_tensors=False)


class McoreCheckpointReader:
    """One iteration of a `pretrain_diff.py` checkpoint, read layer by layer (any TP/PP it was saved at).

    Each tensor is read in the dtype it was saved in (bf16 runs save bf16 weights); no process group
    is needed.
    """

    def __init__(self, root: str, iteration: int | None = None) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        if not os.path.isdir(root):
            raise DiffmegError(f"--load {root} is not a directory")
        self.args, self.path = read_checkpoint_args(root, iteration)
        backend = None
        with contextlib.suppress(OSError, ValueError):
            with open(os.path.join(self.path, "metadata.json")) as f:
                backend = json.load(f).get("sharded_backend")
        if backend != "torch_dist":
            raise DiffmegError(
                f"{self.path} is not a megatron-core torch_dist checkpoint (metadata.json names backend "
                f"{backend!r})"
            )
        self._storage = FileSystemReader(self.path)
        try:
            self.metadata = self._storage.read_metadata().state_dict_metadata
        except Exception as exc:
            raise DiffmegError(f"{self.path} is not a readable checkpoint: {first_line(exc)}") from exc
        if damaged_file(self.path, deep=False) is not None:  # a truncated file: named before any output
            raise DiffmegError(damaged_checkpoint_message(self.path, RuntimeError("damaged")))

    def stored_shape(self, key: str) -> tuple[int, ...] | None:
        meta = self.metadata.get(key)
        return tuple(meta.size) if meta is not None and hasattr(meta, "size") else None

    def check(self, layout: ModelLayout) -> None:
        """Every tensor the layout needs is stored with the shape the layout implies."""
        diff = not isinstance(layout, LlamaLayout)
        kinds = {DiffLayout: "DIFF model", Diff2Layout: "DIFF V2 model", MotifLayout: "Motif model"}
        kind = kinds.get(type(layout), "Transformer baseline")
        if not diff and self.stored_shape(checkpoint_key("self_attention.core_attention.lambda_q1")):
            raise DiffmegError(
                f"args.json describes the Transformer baseline (--no-diff-attention) but {self.path} holds "
                f"differential-attention tensors (lambda vectors); its args.json does not match its weights"
            )
        stored_output = self.stored_shape("output_layer.weight") is not None
        if stored_output == layout.tied:  # a tied model's checkpoint holds the embedding only
            says = "ties its output layer to the word embedding" if layout.tied else "has an output layer"
            holds = "an output-layer tensor" if stored_output else "no output-layer tensor"
            raise DiffmegError(
                f"args.json describes a model that {says} but {self.path} holds {holds}; its args.json does "
                f"not match its weights"
            )
        expected = dict(layout.mcore_global_shapes())
        for local, shape in layout.mcore_layer_shapes().items():
            expected[checkpoint_key(local)] = (layout.num_layers, *shape)
        for key, shape in expected.items():
            stored = self.stored_shape(key)
            if stored is None:
                raise DiffmegError(f"{self.path} has no tensor {key!r}: not a {kind} checkpoint")
            if stored != shape:
                raise DiffmegError(
                    f"{self.path}: shape mismatch for {key!r}: stored {list(stored)}, args.json implies "
                    f"{list(shape)}"
                )

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model weights were saved in."""
        return self.metadata["embedding.word_embeddings.weight"].properties.dtype

    def _load(
        self, requests: dict[str, tuple[str, tuple[int, ...], tuple[int, ...]]]
    ) -> dict[str, torch.Tensor]:
        """requests: name -> (stored key, chunk offsets, chunk shape); returns name -> tensor."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        by_key = {
            key: torch.empty(shape, dtype=self.metadata[key].properties.dtype)
            for key, _, shape in requests.values()
        }
        offsets = {key: offset for key, offset, _ in requests.values()}
        try:
            with warnings.catch_warnings():  # "torch.distributed is disabled ... single process": intended
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(by_key, storage_reader=self._storage, planner=_chunk_planner(offsets), no_dist=True)
        except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
            raise DiffmegError(damaged_checkpoint_message(self.path, exc)) from exc  # the file, its sizes
        return {name: by_key[key] for name, (key, _, _) in requests.items()}

    def read_globals(self, layout: ModelLayout, keys: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Embedding, final norm and output layer (none when tied; or those of them named in `keys`), under
        their state-dict keys."""
        shapes = layout.mcore_global_shapes()
        keys = list(shapes) if keys is None else list(keys)
        return self._load({key: (key, (0,) * len(shapes[key]), shapes[key]) for key in keys})

    def read_layer(self, layout: ModelLayout, layer: int) -> dict[str, torch.Tensor]:
        """Layer `layer` (0-based, global) under its keys relative to `decoder.layers.N.`."""
        requests = {}
        for local, shape in layout.mcore_layer_shapes().items():
            # stored as [num_layers, *shape]: read the [1, *shape] chunk at layer `layer`
            requests[local] = (checkpoint_key(local), (layer,) + (0,) * len(shape), (1, *shape))
        return {name: t[0] for name, t in self._load(requests).items()}


@torch.no_grad()
def fill_model(model: torch.nn.Module, blocks: Iterator[dict[str, torch.Tensor]]) -> None:
    """Copy TP=1 state-dict entries into `model`'s parameters, block by block; every parameter once."""
    params = dict(model.named_parameters())
    filled: set[str] = set()
    for block in blocks:
        for name, tensor in block.items():
            if name not in params:
                raise DiffmegError(f"converted tensor {name!r} has no parameter in the model")
            if tuple(params[name].shape) != tuple(tensor.shape):
                raise DiffmegError(
                    f"shape mismatch for {name!r}: converted {list(tensor.shape)}, "
                    f"model {list(params[name].shape)}"
                )
            params[name].copy_(tensor)
            filled.add(name)
        block.clear()  # drop the converted tensors before the next block arrives
    missing = sorted(set(params) - filled)
    if missing:
        raise DiffmegError(f"no converted tensor for parameter {missing[0]!r} ({len(missing)} in all)")


class HFCheckpointReader:
    """A Hugging Face model folder: config.json and safetensors weights (single file or sharded)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        if not os.path.isdir(directory):
            raise DiffmegError(f"--load {directory} is not a directory")
        config_file = os.path.join(directory, "config.json")
        if not os.path.isfile(config_file):
            raise DiffmegError(f"{directory} has no config.json: not a Hugging Face model folder")
        try:
            with open(config_file) as f:
                self.raw_config = json.load(f)
        except (OSError, ValueError) as exc:
            raise DiffmegError(f"cannot read {config_file}: {first_line(exc)}") from None
        index = os.path.join(directory, INDEX_FILE)
        single = os.path.join(directory, "model.safetensors")
        self._files: dict[str, SafetensorsFile] = {}
        if os.path.isfile(index):
            with open(index) as f:
                self.weight_map: dict[str, str] = json.load(f)["weight_map"]
        elif os.path.isfile(single):
            self.weight_map = dict.fromkeys(self._file("model.safetensors").tensors, "model.safetensors")
        elif any(n.endswith(".bin") for n in os.listdir(directory)):
            raise DiffmegError(
                f"{directory} holds PyTorch .bin weights; save the model with safetensors "
                f"(model.save_pretrained(dir, safe_serialization=True)) and convert that"
            )
        else:
            raise DiffmegError(f"{directory} has no model.safetensors or {INDEX_FILE}")

    def normalized_config(self) -> dict:
        """config.json through transformers' DiffLlamaConfig / LlamaConfig (fills defaults, maps legacy
        rope fields); any other model_type is refused."""
        from diffmeg.conversion.hf_config import check_model_type, transformers_config_class

        layout_class = check_model_type(self.raw_config, f"{self.directory}/config.json")
        if layout_class is MotifLayout:  # Motif's config class is remote code: its keys are read as they are
            return dict(self.raw_config)
        try:
            return transformers_config_class(layout_class).from_dict(dict(self.raw_config)).to_dict()
        except Exception as exc:  # transformers validates the fields (strict dataclass)
            raise DiffmegError(
                f"invalid {layout_class.hf_name} config.json in {self.directory}: {first_line(exc)}"
            ) from None

    def _file(self, filename: str) -> SafetensorsFile:
        """A shard's header, parsed once (tensors are read on demand, without a memory map)."""
        if filename not in self._files:
            path = os.path.join(self.directory, filename)
            if not os.path.isfile(path):
                raise DiffmegError(f"{path} is listed in the index but missing")
            self._files[filename] = SafetensorsFile(path)
        return self._files[filename]

    def _info(self, name: str):
        info = self._file(self.weight_map[name]).tensors.get(name)
        if info is None:
            raise DiffmegError(
                f"{self.directory}: the index puts {name!r} in {self.weight_map[name]}, which lacks it"
            )
        return info

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every stored tensor, read from the headers only."""
        return {name: self._info(name).shape for name in self.weight_map}

    def dtype_of(self, name: str) -> torch.dtype:
        return self._info(name).dtype

    def get(self, names) -> dict[str, torch.Tensor]:
        """The named tensors (only those present), each read now into memory of its own."""
        return {n: self._file(self.weight_map[n]).read(n) for n in names if n in self.weight_map}


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to do
        return None


def release_freed_memory() -> None:
    """Give memory freed since the last call back to the operating system (glibc's `malloc_trim`; a
    no-op elsewhere). Called by the converters after each layer.

    A converter frees each layer's tensors before reading the next, but glibc keeps freed heap pages
    resident and reuses them only in part as tensors of different sizes come and go: without this a
    conversion grows by about half a layer per layer (measured: +116 MB over 20 layers of 12.8 MB).
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def save_hf_tokenizer(tokenizer, directory: str) -> None:
    """save_pretrained, naming the class `PreTrainedTokenizerFast` (loadable by transformers 4 and 5)."""
    tokenizer.save_pretrained(directory)
    path = os.path.join(directory, "tokenizer_config.json")
    with open(path) as f:
        config = json.load(f)
    write_json(path, config | {"tokenizer_class": "PreTrainedTokenizerFast"}, ensure_ascii=False)


def save_remote_code(layout: ModelLayout, directory: str) -> None:
    """Copy the files a layout's config.json names in `auto_map` (DIFF V2's modeling file, Motif's config
    and modeling files) into the folder."""
    from diffmeg.conversion.hf_config import MOTIF_REMOTE_CODE_FILES, REMOTE_CODE_FILE

    names = {Diff2Layout: (REMOTE_CODE_FILE,), MotifLayout: MOTIF_REMOTE_CODE_FILES}.get(type(layout), ())
    for name in names:
        source = os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
        shutil.copyfile(source, os.path.join(directory, name))  # mode follows the umask
