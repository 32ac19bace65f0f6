"""The Trainer: one pretraining run on megatron-core, from a `RunConfig` to its last checkpoint.

State: the model, optimizer and scheduler, and the counters (`TrainState`: iteration, consumed samples,
skipped updates). `train_step()` is one optimizer step (megatron-core's pipeline schedule over this rank's
micro-batches), `evaluate()` the validation loss, `train()` the loop. Around the loop: callbacks
(`diffmeg.training.callbacks`: logs, the NaN guard, signals, --exit-interval) and the `CheckpointManager`
(`diffmeg.training.checkpointing`), in the spirit of torchtitan's Trainer and OLMo-core's callbacks.

Host syncs: a step leaves its loss on the device; the pending losses come to the host once per logging
interval (and before a save or a stop), with the logged lambdas and loss scale, in one copy. The signal
check's one-flag all-reduce per step is the only other host read in the loop, plus, with --async-save, one
while a checkpoint is being written in the background. A micro-batch's forward and backward read nothing
(tests/training/test_host_syncs.py); the optimizer step reads nothing with `--optimizer-impl fused` (fp16:
its overflow flag), megatron-core's own step its grad norm (without TE or apex: once per parameter tensor
and twice more; docs/recipes.md counts them).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from diffmeg import collectives
from diffmeg.compat import model_parallel_manual_seed
from diffmeg.data.gpt_datasets import epoch_note
from diffmeg.model import lambda_parameters
from diffmeg.run_config import RunConfig
from diffmeg.training import ddp
from diffmeg.training.builders import build_training_objects
from diffmeg.training.callbacks import default_callbacks
from diffmeg.training.checkpointing import CheckpointManager, model_chunks
from diffmeg.training.data import build_datasets, microbatches, to_device
from diffmeg.training.distributed import initialize_model_parallel
from diffmeg.training.flops import train_flops_per_iteration
from diffmeg.training.hardware import model_flops_utilization, peak_tflops
from diffmeg.training.hooks import Callback, LogRecord, StepOutput
from diffmeg.training.memory import check_memory_plan


@dataclass
class TrainState:
    """Where the run is: what a checkpoint records besides model, optimizer, scheduler and RNG."""

    iteration: int = 0
    consumed_samples: int = 0
    skipped_iterations: int = 0


def forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module):
    """One micro-batch forward; returns the output and the loss function megatron-core's schedules call."""
    device = next(model.parameters()).device
    batch = to_device(next(data_iterator), device)
    loss_mask = batch["loss_mask"].float()
    output = model(
        input_ids=batch["tokens"],
        position_ids=batch["position_ids"],
        attention_mask=None,
        labels=batch["labels"],
    )

    def loss_func(per_token_loss: torch.Tensor):
        # Mean over the whole sequence. Under context parallelism this rank holds only some tokens:
        # divide its sum by the CP-global token count (megatron-core's schedule then multiplies by the
        # CP size and DDP averages over DP x CP, so the gradient is that of the global mean).
        local_sum = (per_token_loss.float() * loss_mask).sum()
        count = loss_mask.sum()
        cp_group = parallel_state.get_context_parallel_group()
        if cp_group.size() > 1:
            count = collectives.all_reduce(count.clone(), group=cp_group)
        loss = local_sum / count.clamp(min=1)
        reported = loss.detach().clone()  # clone: the schedule scales the returned loss in place
        if cp_group.size() > 1:
            reported = collectives.all_reduce(reported, group=cp_group)
        return loss, {"lm loss": reported}

    return output, loss_func


class Trainer:
    """Builds everything a run needs on this rank (process groups, model, optimizer, scheduler, data),
    resumes as the checkpoint flags say, and trains."""

    def __init__(self, run: RunConfig, callbacks: Sequence[Callback] | None = None) -> None:
        self.run = run
        self.rank, self.world = initialize_model_parallel(run.parallel)
        model_parallel_manual_seed(run.training.seed, cuda_graphs=run.training.cuda_graph_impl == "local")
        # The plan from the run's sizes: one the device cannot hold stops here, before anything is built.
        self.memory_plan = check_memory_plan(run)
        self.num_parameters = self.memory_plan.model_parameters  # the whole model (a tied output layer once)
        self.checkpoints = CheckpointManager(run, log=self.log)
        self.checkpoints.lock_save_target(self.num_parameters)  # one run per --save, room for a checkpoint
        self.checkpoints.resolve()  # a bad --load, or a checkpoint this run cannot start from, stops here
        self.train_ds, self.valid_ds, _ = build_datasets(run)  # data of another vocabulary: before the model
        if note := epoch_note(self.train_ds, run.training.train_iters):
            self.log(note)
        self._rss_before_model = _rss_bytes("VmRSS")
        # `model`: the DDP-wrapped chunks, one per virtual pipeline stage (one without interleaving)
        self.model_config, self.model, self.optimizer, self.scheduler = build_training_objects(run)
        self.device = next(self.model[0].parameters()).device
        # the log records' FLOP/s and MFU: the matmuls' precision picks the device's peak
        self.flops_per_iteration = train_flops_per_iteration(run)
        precision = "fp8" if run.training.fp8_format else run.training.precision
        self.peak_tflops = peak_tflops(self.device, precision)
        if (overlap := ddp.describe(self.model)) is not None:
            self.log(overlap)
        self.state = TrainState(*self.checkpoints.restore(self.model, self.optimizer, self.scheduler))

        self.is_logging_rank = self.rank == self.world - 1  # the last rank holds the loss, as in Megatron-LM
        self.callbacks = (
            list(callbacks) if callbacks is not None else default_callbacks(run, self.is_logging_rank)
        )
        self.stop_reason: str | None = None
        self.interrupted = False
        self.last_loss = math.nan
        self._lambdas: dict[str, float] = {}
        self._pending: list[tuple[int, torch.Tensor | None]] = []  # losses not yet on the host

    # ------------------------------------------------------------------------------------------ set-up

    def log(self, line: str) -> None:
        """Print on rank 0."""
        if self.rank == 0:
            print(line, flush=True)

    # ------------------------------------------------------------------------------------------ steps

    def _forward_backward(self, batches: Iterator, forward_only: bool) -> torch.Tensor | None:
        """This rank's mean loss over the micro-batches (last stage; a device scalar), else None."""
        training = self.run.training
        losses = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=batches,
            model=self.model,
            num_microbatches=self.run.num_microbatches,
            seq_length=self.run.model.seq_length,
            micro_batch_size=training.micro_batch_size,
            forward_only=forward_only,
        )
        if parallel_state.is_pipeline_last_stage():
            return torch.stack([d["lm loss"] for d in losses]).mean()
        return None

    def _batches(self, dataset, start: int) -> Iterator[dict[str, torch.Tensor]] | list[Iterator]:
        """This rank's micro-batches of the global batch at `start`; under the interleaved schedule one
        iterator per model chunk (each chunk's forward step reads every micro-batch once)."""
        training = self.run.training

        def one() -> Iterator[dict[str, torch.Tensor]]:
            return microbatches(
                dataset,
                start,
                training.global_batch_size,
                training.micro_batch_size,
                pin_memory=self.device.type == "cuda",
            )

        return [one() for _ in self.model] if len(self.model) > 1 else one()

    def train_step(self) -> StepOutput:
        """One optimizer step over the next global batch; advances the counters."""
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        loss = self._forward_backward(self._batches(self.train_ds, self.state.consumed_samples), False)
        update_ok, grad_norm, _ = self.optimizer.step()
        self.state.iteration += 1
        self.state.consumed_samples += self.run.training.global_batch_size
        if update_ok:
            self.scheduler.step(increment=1)
        else:
            self.state.skipped_iterations += 1
        return StepOutput(self.state.iteration, loss, grad_norm, bool(update_ok))

    def evaluate(self) -> float:
        """Mean validation loss over `--eval-iters` global batches (deterministic: always the first ones)."""
        iters, batch = self.run.logging.eval_iters, self.run.training.global_batch_size
        self._set_training(False)
        with torch.no_grad(), ddp.params_gathered(self.model):  # full weights, no param-gather hooks
            losses = [
                self._forward_backward(self._batches(self.valid_ds, i * batch), True) for i in range(iters)
            ]
        self._set_training(True)
        values, _ = self._to_host(losses)
        return sum(values) / max(1, iters)

    def _set_training(self, mode: bool) -> None:
        for chunk in self.model:
            chunk.train(mode)

    def _to_host(
        self, losses: list[torch.Tensor | None], extras: Sequence[torch.Tensor] = ()
    ) -> tuple[list[float], list[float]]:
        """Losses averaged over data- and context-parallel ranks and known on every rank, plus this rank's
        `extras`, on the host: two small all-reduces and one device-to-host copy.

        Every CP rank holds the same number of tokens, so the mean of their means is the sequence mean.
        """
        n = len(losses)
        shared = collectives.small_tensor([0.0] * (n + 1))
        if parallel_state.is_pipeline_last_stage() and n:
            group = parallel_state.get_data_parallel_group(with_context_parallel=True)
            local = collectives.all_reduce(
                torch.stack(losses), group=group
            ) / torch.distributed.get_world_size(group)
            shared[:n] = local.double()
            shared[n] = 1.0
        collectives.all_reduce(shared)  # sum over the last stage's ranks, which hold the same values
        values = shared[:n] / shared[n].clamp(min=1)
        flat = [values] + [e.detach().double().flatten().to(values.device) for e in extras]
        host = torch.cat(flat).tolist()
        return host[:n], host[n:]

    # ------------------------------------------------------------------------------------------ loop

    def request_stop(self, reason: str, interrupted: bool = False) -> None:
        """Save (with --save) and stop after this step; `interrupted`: Ctrl-C (the exit status says so)."""
        if self.stop_reason is None:
            self.stop_reason = reason
        self.interrupted = self.interrupted or interrupted

    def _call(self, hook: str, *args) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(self, *args)

    def _end(self) -> None:
        """Every callback's `on_train_end`, even after one raised (signal handlers restored, the background
        writer stopped), and --save's lock released; then the first error (e.g. a log write that failed) is
        raised."""
        errors = []
        for callback in self.callbacks:
            try:
                callback.on_train_end(self)
            except Exception as exc:
                errors.append(exc)
        self.checkpoints.close()  # --save's lock goes with training
        if errors:
            raise errors[0]

    def _flush(self, log_step: bool) -> float | None:
        """Bring the pending losses to the host (the callbacks' `on_losses`, e.g. the NaN guard, see them);
        at a logging step also the lambdas (kept for the log record) and the loss scale, which it returns
        (None at other steps)."""
        extras, lambdas = [], {}
        if log_step:
            ddp.finish_param_gather(self.model)  # the step's updated lambdas, not this rank's stale copy
            lambdas = lambda_parameters(model_chunks(self.model))
            extras = [self.optimizer.get_loss_scale().reshape(1), *(v.reshape(1) for v in lambdas.values())]
        iterations = [it for it, _ in self._pending]
        values, extra_values = self._to_host([loss for _, loss in self._pending], extras)
        self._pending.clear()
        losses = dict(zip(iterations, values, strict=True))
        if values:
            self.last_loss = values[-1]
        self._call("on_losses", losses)
        loss_scale, *lambda_values = extra_values if log_step else [None]
        self._lambdas = dict(zip(lambdas, lambda_values, strict=True))
        return loss_scale

    def _log(self, out: StepOutput, loss_scale: float, seconds: float, iterations: int, early: bool) -> None:
        """The callbacks' `on_log` for `out`'s iteration, timed over the `iterations` since the last one;
        its throughput, FLOP/s per device and MFU are worked out here, once for every log sink."""
        run, state = self.run, self.state
        elapsed_ms = seconds / iterations * 1000
        tflops = self.flops_per_iteration / elapsed_ms * 1e3 / run.parallel.world_size / 1e12
        record = LogRecord(
            iteration=out.iteration,
            train_iters=run.training.train_iters,
            consumed_samples=state.consumed_samples,
            elapsed_ms=elapsed_ms,
            lr=self.optimizer.param_groups[0]["lr"],
            global_batch_size=run.training.global_batch_size,
            loss=self.last_loss,
            grad_norm=None if out.grad_norm is None else float(out.grad_norm),
            loss_scale=loss_scale,
            lambdas=self._lambdas,
            skipped=state.skipped_iterations,
            tokens_per_second=run.tokens_per_step / elapsed_ms * 1e3,
            tflops=tflops,
            mfu=model_flops_utilization(tflops, self.peak_tflops),
            early=early,
        )
        self._call("on_log", record)

    def train(self) -> dict:
        """Train to --train-iters (or until a callback stops the run). Returns a summary for callers."""
        run, state = self.run, self.state
        train_iters, log_interval = run.training.train_iters, run.logging.log_interval
        window_start, window_iters = time.perf_counter(), 0
        first = state.iteration + 1  # this run's first iteration (a resume's too) gets an early line
        self._set_training(True)
        self._call("on_train_start")
        try:
            while state.iteration < train_iters:
                out = self.train_step()
                self._pending.append((out.iteration, out.loss))
                window_iters += 1
                self._call("on_step_end", out)
                it, stopping = out.iteration, self.stop_reason is not None
                final = it == train_iters
                save = self.checkpoints.due(it, final or stopping)
                log_step = it % log_interval == 0 or final
                early = it == first and not log_step
                if log_step or early or save or stopping:
                    loss_scale = self._flush(log_step or early)
                    if log_step or early:
                        self._log(out, loss_scale, time.perf_counter() - window_start, window_iters, early)
                        window_start, window_iters = time.perf_counter(), 0
                if (
                    self.valid_ds is not None
                    and run.logging.eval_iters > 0
                    and it % run.logging.eval_interval == 0
                ):
                    self._call("on_evaluation", it, self.evaluate())
                if save:
                    ddp.finish_param_gather(self.model)  # the weights of this step on every rank
                    self.checkpoints.save(
                        it, state.consumed_samples, self.model, self.optimizer, self.scheduler
                    )
                if self.stop_reason is not None:
                    self.log(f" exiting at iteration {it} ({self.stop_reason})")
                    break
            self.checkpoints.wait()  # an --async-save checkpoint still being written
            ddp.finish_param_gather(self.model)  # a caller of train() reads the final weights
        finally:
            self._end()
        memory = self._memory_report()
        if self.is_logging_rank:
            print(
                f" memory (MiB) | measured peak: {memory['measured_peak_mib']:.1f} | "
                f"estimated: {memory['estimated_mib']:.1f} | ({memory['what']})",
                flush=True,
            )
        return {
            "iteration": state.iteration,
            "consumed_samples": state.consumed_samples,
            "lm_loss": self.last_loss,
            "memory": memory,
            "stop_reason": self.stop_reason,
            "exit_code": 130 if self.interrupted else 0,
        }

    def _memory_report(self) -> dict:
        """Measured peak vs the memory plan (GPU: allocator peak; CPU: RSS growth since the model build)."""
        estimate = self.memory_plan
        if torch.cuda.is_available():
            measured, what = torch.cuda.max_memory_allocated(), "GPU max allocated"
        else:
            measured = _rss_bytes("VmHWM") - self._rss_before_model
            what = "CPU peak RSS growth since model build"
        return {"measured_peak_mib": measured / 2**20, "estimated_mib": estimate.total / 2**20, "what": what}


def _rss_bytes(field: str) -> int:
    """VmRSS / VmHWM (peak) of this process from /proc, in bytes (0 where /proc is unavailable)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
