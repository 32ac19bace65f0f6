"""No host sync in a micro-batch's forward or backward: the Trainer's forward_backward over two micro-batches
of a tiny DIFF V1 and Transformer reads nothing back to the host (counted on a CPU by tests/host_reads.py).
The optimizer step's count is tests/fusions/test_optimizer_step.py's."""

from __future__ import annotations

import pytest
import torch

from diffmeg.run_config import RunConfig
from diffmeg.training.arguments import resolve_args
from tests.host_reads import host_reads
from tests.training.helpers import SMALL


@pytest.fixture(scope="module", params=["diff-tiny", "transformer-tiny"])
def trainer(request):
    from diffmeg import runtime
    from diffmeg.training.builders import release_training_objects
    from diffmeg.training.trainer import Trainer

    runtime.single_process()
    run = RunConfig.from_args(resolve_args(["--model", request.param, *SMALL], world_size=1))
    trainer = Trainer(run, callbacks=[])
    for chunk in trainer.model:
        chunk.train()
    trainer.train_step()  # the optimizer state and DDP buckets as in training
    yield trainer
    release_training_objects(trainer.model_config, trainer.model)


def _forward_backward(trainer) -> list[str]:
    """The host reads of one forward_backward over the run's two micro-batches."""
    assert trainer.run.num_microbatches == 2
    with host_reads() as reads:
        trainer._forward_backward(trainer._batches(trainer.train_ds, 0), False)
    return reads


def test_forward_and_backward_read_nothing_back_to_the_host(trainer):
    assert _forward_backward(trainer) == []


def test_a_read_in_the_forward_or_backward_is_counted_with_its_line(trainer):
    """The count can fail: an `.item()` in a layer's forward, a `bool()` in its backward, each named by
    its line, once per micro-batch."""
    layer = trainer.model[0].module.decoder.layers[0]

    def read_in_forward(module, args, output) -> None:
        output[0].sum().item()

    def read_in_backward(module, args, output) -> None:
        output[0].register_hook(lambda grad: None if bool(grad.sum() > 0) else None)

    first = read_in_forward.__code__.co_firstlineno + 1
    for hook, line in ((read_in_forward, first), (read_in_backward, first + 3)):
        handle = layer.register_forward_hook(hook)
        try:
            reads = _forward_backward(trainer)
        finally:
            handle.remove()
        assert reads == [f"item at {__file__}:{line}"] * 2


def test_values_gathered_into_a_new_tensor_and_masked_indexing_are_counted():
    """The reads that are no `.item()`: a list of tensors made one (megatron-core's grad norm without
    apex), `.tolist()`, and a boolean mask that sizes a result; a scalar written through a mask is none."""
    t, mask = torch.arange(4.0), torch.tensor([True, False, True, False])
    with host_reads() as reads:
        torch.tensor([[t[0], t[1]], [t[2], t[3]]])
        t.tolist()
        t[mask]
        t[mask] = 0.0
    assert [r.split(" at ")[0] for r in reads] == ["torch.tensor of a tensor"] * 4 + [
        "tolist",
        "boolean-mask index",
    ]
