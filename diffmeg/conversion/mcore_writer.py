"""A megatron-core dist checkpoint written one part (a layer, or one module outside the layers) at a time.

A training run saves `model.sharded_state_dict()` with one `dist_checkpointing.save`: the whole model in
memory at once. This writer produces the same directory while holding one part:

- The model is a *skeleton*: the TP=PP=1 GPTModel `pretrain_diff.py` builds for the arguments, built
  without initialising its weights, every parameter then replaced by a placeholder of its shape backed by
  one element. A 3B skeleton builds in 0.2 s and holds no memory.
- `write(tensors)` puts one part's (a layer's, or one module's outside the layers) converted tensors into
  the skeleton's parameters, takes the entries of the skeleton's own `sharded_state_dict()` that belong to
  that part (its tensors and its modules' extra states, under the keys, layer offsets and chunks a training
  run writes) and saves them as megatron-core's torch_dist strategy does (same preprocessing, same
  PyTorch-DCP planner), into files of their own (`__{n}_0.distcp`). The part's parameters then go back to
  placeholders.
- `close()` writes one `.metadata` for all parts (their chunk lists concatenated; a part's chunks never
  overlap another's), `common.pt` (iteration, arguments, `weights_only`), `metadata.json`, `args.json`
  and the tracker: what `dist_checkpointing.save` of the whole model followed by the tracker update
  writes, loadable at any TP/PP.

Memory: the part being written (the caller's tensors; nothing is copied unless a cast is needed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import warnings
from collections.abc import Mapping

import torch

from diffmeg.errors import DiffmegError

_LAYER_PATH = re.compile(r"decoder\.layers\.(\d+)\.")


def part_of(name: str) -> int | str:
    """The part a state-dict entry belongs to: its layer's index, else its top-level module ("embedding",
    "output_layer"; the decoder's children other than its layers count as top level:
    "decoder.final_layernorm"). One part is one write: a layer, or one tensor as large as the embedding."""
    match = _LAYER_PATH.match(name)
    if match:
        return int(match.group(1))
    head, _, rest = name.partition(".")
    return f"{head}.{rest.partition('.')[0]}" if head == "decoder" else head


def build_skeleton_model(args: argparse.Namespace, dtype: torch.dtype) -> torch.nn.Module:
    """The TP=PP=1 GPTModel `diffmeg.model.build_model` builds for `args`, on the CPU, its weights not
    initialised (allocated, never written: not resident; the writer swaps them for placeholders at once).
    Needs `diffmeg.runtime.single_process()`.

    Same construction as `build_model` without its `initialize_parameters` pass (which writes every
    weight); tests/conversion/test_mcore_writer.py checks that the checkpoint equals a training save of
    `build_single_rank_model`'s model, so a change there that alters the state dict fails that test.
    """
    from megatron.core.models.gpt import GPTModel

    from diffmeg.checkpoints import single_rank_args
    from diffmeg.layer_specs import get_diff_block_spec
    from diffmeg.model import transformer_config
    from diffmeg.run_config import RunConfig

    args = single_rank_args(args)
    args.bf16, args.fp16 = dtype == torch.bfloat16, dtype == torch.float16
    config = transformer_config(RunConfig.from_args(args, partial=True))
    config.use_cpu_initialization = True  # the converter's tensors live on the CPU
    config.perform_initialization = False
    return GPTModel(
        config=config,
        transformer_layer_spec=get_diff_block_spec(config, use_te=False),
        vocab_size=args.vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=config.share_embeddings_and_output_weights,
        position_embedding_type="rope",
        rotary_base=args.rotary_base,
        parallel_output=True,
    )


def _placeholder(param: torch.Tensor) -> torch.Tensor:
    """A tensor of `param`'s shape and dtype backed by one element (stride 0): what the skeleton holds
    for every part not being written, so its memory is nil whatever the model's size."""
    return torch.zeros((), dtype=param.dtype).expand(param.shape)


def _without_prepended_axes(value):
    """A layer's ShardedTensor with its layer axis in the data ([1, *shape] at offset (l, 0, ...)).

    megatron-core marks layer tensors as [*shape] plus one prepended (layer) axis. Its torch_dist strategy
    turns those into one torch ShardedTensor per key that must hold every layer's chunk present in the
    process (a whole model at once); written explicitly as [1, *shape] chunks they take its other path
    (one checkpointable shard per chunk), which writes the same chunk (offsets, sizes, bytes) and metadata.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if not isinstance(value, ShardedTensor) or value.prepend_axis_num == 0:
        return value
    ones = (1,) * value.prepend_axis_num
    return dataclasses.replace(
        value,
        data=value.data.reshape(ones + tuple(value.data.shape)),
        local_shape=ones + tuple(value.local_shape),
        prepend_axis_num=0,
    )


def _part_writer_class():
    from torch.distributed.checkpoint import FileSystemWriter

    class PartWriter(FileSystemWriter):
        """DCP's file writer, with this part's file prefix, keeping the part's metadata for `close`."""

        def __init__(self, path: str, prefix: str) -> None:
            super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1)
            self.prefix = prefix
            self.metadata = None
            self.results: list = []

        def prepare_global_plan(self, plans):
            plans = super().prepare_global_plan(plans)
            return [
                dataclasses.replace(p, storage_data=dataclasses.replace(p.storage_data, prefix=self.prefix))
                for p in plans
            ]

        def finish(self, metadata, results) -> None:
            self.metadata, self.results = metadata, results  # the `.metadata` file is written once, at close

    return PartWriter


class StreamingCheckpointWriter:
    """`{root}/iter_{iteration}` as a weights-only `pretrain_diff.py` checkpoint, one part at a time.

    Call `write` once per part (`part_of`: each layer, the embedding, the final norm, the output layer; in
    any order) with that part's TP=1 state-dict tensors, then `close`. Needs
    `diffmeg.runtime.single_process()`.
    """

    def __init__(
        self, root: str, args: argparse.Namespace, dtype: torch.dtype, *, iteration: int = 0
    ) -> None:
        from diffmeg.checkpoints import checkpoint_path

        self.root, self.args, self.dtype, self.iteration = root, args, dtype, iteration
        self.path = checkpoint_path(root, iteration)
        self.model = build_skeleton_model(args, dtype)
        self._params = dict(self.model.named_parameters())
        for param in self._params.values():
            param.data = _placeholder(param)
        self._pending = {part_of(name) for name in self._params}
        self._metadata: dict = {}
        self._results: list = []
        self._common: dict = {}
        self._files = 0
        os.makedirs(self.path)

    @property
    def parts(self) -> set[int | str]:
        """Parts not written yet."""
        return set(self._pending)

    def _check(self, tensors: Mapping[str, torch.Tensor]) -> dict[int | str, list[str]]:
        """The tensors' names by part; every part complete, new, and of the model's shapes."""
        by_part: dict[int | str, list[str]] = {}
        for name, tensor in tensors.items():
            if name not in self._params:
                raise DiffmegError(f"converted tensor {name!r} has no parameter in the model")
            if tuple(self._params[name].shape) != tuple(tensor.shape):
                raise DiffmegError(
                    f"shape mismatch for {name!r}: converted {list(tensor.shape)}, "
                    f"model {list(self._params[name].shape)}"
                )
            by_part.setdefault(part_of(name), []).append(name)
        for part in by_part:
            if part not in self._pending:
                raise DiffmegError(f"part {part} of the checkpoint was written already")
            missing = sorted(n for n in self._params if part_of(n) == part and n not in tensors)
            if missing:
                raise DiffmegError(
                    f"no converted tensor for parameter {missing[0]!r} ({len(missing)} in all)"
                )
        return by_part

    @torch.no_grad()
    def write(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Save whole parts (`part_of`): every parameter of a layer, of the embedding, ...; cast to the
        checkpoint's dtype here. Memory: the tensors given (a part per call keeps it to one part)."""
        for part, names in self._check(tensors).items():
            try:
                for name in names:
                    self._params[name].data = tensors[name].detach().to(self.dtype).contiguous()
                state = {k: v for k, v in self.model.sharded_state_dict().items() if part_of(k) == part}
                self._save_part({"model": state})
            finally:
                for name in names:
                    self._params[name].data = _placeholder(self._params[name])
            self._pending.discard(part)

    def _save_part(self, state: dict) -> None:
        """What megatron-core's TorchDistSaveShardedStrategy does with a state dict, into this part's file."""
        import torch.distributed.checkpoint as dcp
        from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, merge
        from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
        from megatron.core.dist_checkpointing.strategies.torch import (
            MCoreSavePlanner,
            _replace_state_dict_keys_with_sharded_keys,
            mcore_to_pyt_state_dict,
        )

        # No coverage check: a part holds a slice of each stacked key, never a whole one.
        sharded, common = save_preprocess(state, validate_access_integrity=False)
        merge(self._common, common)
        dict_list_map_inplace(_without_prepended_axes, sharded)
        grouped, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded, keep_only_main_replica=True)
        writer = _part_writer_class()(self.path, prefix=f"__{self._files}_")
        self._files += 1
        with warnings.catch_warnings():  # "torch.distributed is disabled ... single process": intended
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(
                mcore_to_pyt_state_dict(grouped, is_loading=False),
                storage_writer=writer,
                planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False),
                no_dist=True,
            )
        for key, meta in writer.metadata.state_dict_metadata.items():
            known = self._metadata.get(key)
            if known is None:
                self._metadata[key] = meta
                continue
            stacked = hasattr(meta, "chunks") and hasattr(known, "chunks")  # objects: one key per layer
            if not stacked or (meta.size, meta.properties) != (known.size, known.properties):
                raise DiffmegError(f"checkpoint key {key!r} was written twice with different layouts")
            known.chunks.extend(meta.chunks)  # another layer's slice of a stacked key
        self._results += writer.results

    def close(self) -> str:
        """Write the checkpoint's metadata, common state, args.json and tracker; returns `iter_N`."""
        from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
        from megatron.core.dist_checkpointing.serialization import (
            get_default_save_common_strategy,
            get_default_save_sharded_strategy,
        )
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint.metadata import Metadata

        from diffmeg.checkpoints import ARGS_FILE, WEIGHTS_ONLY_KEY, write_tracker

        if self._pending:
            first = sorted(self._pending, key=str)[0]
            raise DiffmegError(f"part {first} was never written ({len(self._pending)} part(s) missing)")
        # Metadata as torch's writer finishes it (version, storage_data from the write results, storage_meta)
        FileSystemWriter(self.path).finish(Metadata(state_dict_metadata=self._metadata), self._results)
        common = {
            **self._common,  # non-sharded model entries, if an architecture has any
            "iteration": self.iteration,
            "consumed_samples": 0,
            "layout": {
                "tp": self.args.tensor_model_parallel_size,
                "pp": self.args.pipeline_model_parallel_size,
                "dp": 1,
            },
            "args": json.dumps(vars(self.args), default=str),
            WEIGHTS_ONLY_KEY: True,
        }
        common_strategy = get_default_save_common_strategy()
        common_strategy.save_common(common, self.path)
        sharded_strategy = get_default_save_sharded_strategy()
        save_config(CheckpointingConfig(sharded_strategy.backend, sharded_strategy.version), self.path)
        with open(os.path.join(self.path, ARGS_FILE), "w") as f:
            json.dump(vars(self.args), f, indent=2, default=str)
        write_tracker(self.root, self.iteration)
        return self.path
