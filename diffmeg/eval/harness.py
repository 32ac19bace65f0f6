"""lm-evaluation-harness on diffmeg checkpoints: the model, in memory, as an lm-eval language model.

The DIFF paper's zero-shot table (ARC-Challenge, ARC-Easy, BoolQ, HellaSwag, OBQA, PIQA, WinoGrande) is
lm-eval's. `DiffmegLM` answers lm-eval's three requests with the single-rank model
`diffmeg.checkpoints` builds, so what is scored is the model every other evaluation here scores, for
every input they take (checkpoints of any TP/PP layout, Hugging Face folders, mock-vocabulary models,
DIFF V2, which has no transformers class), with no export written to disk:
* `loglikelihood`: lm-eval's own tokenisation of (context, continuation) (`TemplateLM`), then the
  continuation's summed log-probabilities from one forward pass, and whether each of its tokens is the
  argmax; the input is cut on the left to the model's length, as lm-eval's HF model does;
* `loglikelihood_rolling`: lm-eval's disjoint windows of at most the model's length, the first
  conditioned on the end-of-document token (what `tools/eval_long_context.py --prefix-eod` scores);
* `generate_until`: greedy decoding with the KV cache (`diffmeg.generation`), cut at the first stop
  string.
Text becomes ids with cl100k_base, or, for a mock-vocabulary checkpoint, as whitespace-separated ids
("17 4 250"): tasks for such models are written in ids.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from diffmeg.data.tokenizers import text_tokenizer
from diffmeg.errors import DiffmegError, stderr
from diffmeg.eval import common
from diffmeg.eval.long_context import final_hidden_states
from diffmeg.generation import SamplingConfig, generate
from diffmeg.model import output_logits

try:
    import lm_eval
    from lm_eval.api.model import TemplateLM
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as exc:
    raise DiffmegError(
        f"lm-evaluation-harness is not installed ({exc}): pip install 'diffmeg[harness]' (or 'lm-eval[hf]')"
    ) from None

PRESETS = {
    "paper": ["arc_challenge", "arc_easy", "boolq", "hellaswag", "openbookqa", "piqa", "winogrande"],
}
"""Named task lists: `paper` is the DIFF paper's zero-shot table."""
RESULTS_NAME = "harness_results.json"
CSV_NAME = "harness_results.csv"
SAMPLES_NAME = "harness_samples.jsonl"
SEEDS = ("random_seed", "numpy_random_seed", "torch_random_seed", "fewshot_random_seed")
"""`simple_evaluate`'s seeds, all set to the run's `--seed`."""


class IdText:
    """Text as whitespace-separated token ids, for checkpoints whose ids mean no text (mock data)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def tokenize(self, text: str) -> list[int]:
        try:
            ids = [int(t) for t in text.split()]
        except ValueError:
            raise DiffmegError(
                f"this checkpoint reads token ids, not text: write its tasks as whitespace-separated ids "
                f"below {self.vocab_size}, got {text[:60]!r}"
            ) from None
        if any(not 0 <= i < self.vocab_size for i in ids):
            raise DiffmegError(
                f"task text {text[:60]!r} holds an id outside the vocabulary of {self.vocab_size}"
            )
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


class DiffmegLM(TemplateLM):
    """A loaded diffmeg model (single rank, eval mode) as an lm-eval language model."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        eod: int,
        max_length: int,
        batch_size: int = 1,
        max_gen_toks: int = 256,
    ) -> None:
        super().__init__()
        self.model, self.text, self.eod = model, tokenizer, eod
        self.max_length, self.batch_size, self.max_gen_toks = max_length, batch_size, max_gen_toks
        self._device = next(model.parameters()).device

    @property
    def eot_token_id(self) -> int:
        return self.eod

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.text.tokenize(string)

    def tok_decode(self, ids: Sequence[int]) -> str:
        return self.text.detokenize(ids)

    @torch.no_grad()
    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, **kwargs
    ) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), continuation is the greedy choice) per request of
        (cache key, context ids, continuation ids); batched by length, padded on the right."""
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            rows = []
            for i in batch:
                _, context, continuation = requests[i]
                if not continuation:
                    raise DiffmegError("lm-eval asked for the log-likelihood of an empty continuation")
                whole = (list(context) + list(continuation))[-(self.max_length + 1) :]
                rows.append((whole[:-1], whole[-len(continuation) :]))
            width = max(len(inputs) for inputs, _ in rows)
            ids = torch.zeros(len(rows), width, dtype=torch.long, device=self._device)  # causal: pads unseen
            for r, (inputs, _) in enumerate(rows):
                ids[r, : len(inputs)] = torch.as_tensor(inputs)
            hidden = final_hidden_states(self.model, ids)  # [s, b, h]
            for r, (i, (inputs, targets)) in enumerate(zip(batch, rows, strict=True)):
                n = len(targets)
                last = hidden[len(inputs) - n : len(inputs), r : r + 1]  # [n, 1, h]
                logits = output_logits(self.model, last)  # [n, 1, V]
                logp = torch.log_softmax(logits[:, 0].float(), dim=-1)  # [n, V]
                target = torch.as_tensor(targets, device=self._device)
                score = float(logp.gather(-1, target[:, None]).sum())
                results[i] = (score, bool((logp.argmax(-1) == target).all()))
                key = requests[i][0]
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, results[i])
        return results  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document's summed log-likelihood over lm-eval's disjoint windows (the first conditioned on
        the end-of-document token)."""
        out = []
        for (string,) in (req.args for req in requests):
            windows = [
                (None, *make_disjoint_window(w))
                for w in get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            total = sum(score for score, _ in self._loglikelihood_tokens(windows))
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            out.append(total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuation of each context, up to `max_gen_toks` tokens or the end-of-document token,
        cut before the first of the request's stop strings."""
        out = []
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = dict(gen_kwargs)
            if kwargs.get("do_sample") and kwargs.get("temperature", 0.0) > 0.0:
                raise DiffmegError("diffmeg's lm-eval model decodes greedily; the task asked for sampling")
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            prompt = self.tok_encode(context)[-max(1, self.max_length - max_new) :]
            result = generate(self.model, prompt, max_new, SamplingConfig(greedy=True), eod_id=self.eod)
            ids = [t for t in result.output_ids if t != self.eod]
            text = self.tok_decode(ids)
            cuts = [text.index(stop) for stop in until if stop and stop in text]
            text = text[: min(cuts)] if cuts else text
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out


def resolve_tasks(names: Sequence[str]) -> list[str]:
    """Task names with presets expanded (`paper`: the DIFF paper's zero-shot list), each once, in order."""
    tasks: list[str] = []
    for name in names:
        for task in PRESETS.get(name, [name]):
            if task not in tasks:
                tasks.append(task)
    if not tasks:
        raise DiffmegError(
            f"give --tasks: lm-eval task names, task YAML files, or a preset ({', '.join(PRESETS)})"
        )
    return tasks


def check_tasks(tasks: Sequence[str], known: Collection[str]) -> None:
    """Every task is one of lm-eval's `known` names (tasks, groups, tags) or an existing task YAML, else one
    line naming it with the nearest names (a typo would otherwise end in lm-eval's KeyError traceback after
    the checkpoints loaded)."""
    for task in tasks:
        if task in known or os.path.isfile(task):
            continue
        if task.endswith((".yaml", ".yml")) or os.sep in task:
            raise DiffmegError(f"task file {task} does not exist")
        near = difflib.get_close_matches(task, list(known), n=5, cutoff=0.6)
        hint = f"nearest: {', '.join(near)}" if near else "give an lm-eval task or group name, or a task YAML"
        raise DiffmegError(f"unknown task {task!r}; {hint}")


def load_task_data(tasks: Sequence[str], manager) -> None:
    """Build the tasks as `simple_evaluate` will (their datasets downloaded or read from the cache) before any
    checkpoint loads: a missing local data file or a dataset an offline machine has not cached is one line
    naming it and what to do, not `datasets`' traceback."""
    from lm_eval.tasks import get_task_dict

    try:
        get_task_dict(list(tasks), manager)
    except FileNotFoundError as exc:
        if type(exc).__name__ == "LocalEntryNotFoundError":  # huggingface_hub, offline: not in its cache
            raise DiffmegError(_offline_line(str(exc), tasks)) from None
        found = re.search(r"Unable to find '([^']+)'", str(exc))
        missing = found.group(1) if found else str(exc)
        named_by = [t for t in tasks if os.path.isfile(t) and missing in open(t, encoding="utf-8").read()]
        where = f" (named by task file {', '.join(named_by)})" if named_by else ""
        raise DiffmegError(
            f"task data file {missing} does not exist{where}: fix the task's dataset_kwargs data_files path"
        ) from None
    except ConnectionError as exc:  # datasets' "Couldn't reach ... on the Hub", huggingface_hub offline mode
        raise DiffmegError(_offline_line(str(exc), tasks)) from None


def _offline_line(message: str, tasks: Sequence[str]) -> str:
    found = re.search(r"'([^'\s]+)'", message)  # "Couldn't reach 'allenai/ai2_arc' on the Hub"
    dataset = f"the dataset {found.group(1)}" if found else "a dataset"
    fetch = (
        'python -c "from lm_eval.tasks import TaskManager, get_task_dict; '
        f'get_task_dict({list(tasks)!r}, TaskManager())"'
    )
    return (
        f"lm-eval needs {dataset} from the Hugging Face Hub, which this machine cannot reach (offline, or "
        "HF_DATASETS_OFFLINE/HF_HUB_OFFLINE set) and has not cached: on a machine with network run "
        f"`{fetch}` with the same HF_HOME, copy that folder here, and keep HF_DATASETS_OFFLINE=1 "
        "HF_HUB_OFFLINE=1"
    )


@dataclass
class HarnessConfig(common.EvalConfig):
    tasks: list[str] = field(default_factory=lambda: ["paper"])
    """lm-eval task or group names, task YAML files, or presets (`PRESETS`)."""
    num_fewshot: int | None = None
    """Few-shot examples per prompt (None: each task's default; the paper's table is zero-shot)."""
    limit: float | None = None
    """Documents per task (a whole number), or a fraction of them (below 1); None: all."""
    include_path: str | None = None
    """A directory of extra task YAMLs (lm-eval's --include_path)."""
    batch_size: int = 8
    max_length: int | None = None
    """Tokens the model sees per request (default: its training length)."""
    max_gen_toks: int = 256
    tokenizer_file: str | None = None
    log_samples: bool = False
    """Also write every scored request and response (harness_samples.jsonl)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_positive("batch_size", "max_length", "max_gen_toks")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise DiffmegError(f"--num-fewshot must be >= 0, got {self.num_fewshot}")
        if self.limit is not None and (
            self.limit <= 0 or (self.limit >= 1 and self.limit != int(self.limit))
        ):
            raise DiffmegError(f"--limit takes a document count or a fraction below 1, got {self.limit}")


def _metrics(task_results: dict) -> dict[str, float]:
    """lm-eval's `{"acc,none": 0.5, "acc_stderr,none": ...}` as `{"acc": 0.5, "acc_stderr": ...}`."""
    out = {}
    for key, value in task_results.items():
        metric, _, filt = key.partition(",")
        if isinstance(value, int | float) and not isinstance(value, bool) and key != "alias":
            out[metric if filt in ("", "none") else f"{metric},{filt}"] = float(value)
    return out


def run_harness(cfg: HarnessConfig, log: common.Log = stderr) -> dict:
    """Every checkpoint on every task through lm-eval's `simple_evaluate`; writes harness_results.json,
    harness_results.csv (label, task, metric, value) and, with `log_samples`, harness_samples.jsonl."""
    from lm_eval.tasks import TaskManager  # optional dependency; its task index loads slowly

    tasks = resolve_tasks(cfg.tasks)
    common.prepare_output_dir(cfg.output_dir)
    infos = cfg.checkpoints.resolve()
    # How each checkpoint's ids are written as text (a missing tokenizer fails now): its tokenizer
    # (cl100k_base or its Hugging Face tokenizer), or whitespace-separated ids.
    texts = {
        i.root: IdText(i.vocab_size) if i.tokenizer == "mock" else text_tokenizer(i.args, cfg.tokenizer_file)
        for i in infos
    }
    # Indexing lm-eval's own ~10k task files takes tens of seconds: skip it when every task is a YAML file.
    own_only = all(os.path.isfile(task) for task in tasks)
    manager = TaskManager(include_path=cfg.include_path, include_defaults=not own_only)
    check_tasks(tasks, manager.task_index)
    load_task_data(tasks, manager)
    limit = int(cfg.limit) if cfg.limit is not None and cfg.limit >= 1 else cfg.limit
    results, rows, samples = {}, [], []
    for info, model in common.loaded_models(infos, cfg.dtype, cfg.seed):
        lm = DiffmegLM(
            model,
            texts[info.root],
            common.eod_id(info),
            cfg.max_length or info.seq_length,
            cfg.batch_size,
            cfg.max_gen_toks,
        )
        log(f"{info.label}: lm-eval {lm_eval.__version__} on {', '.join(tasks)}")
        out = lm_eval.simple_evaluate(
            model=lm,
            tasks=tasks,
            num_fewshot=cfg.num_fewshot,
            limit=limit,
            task_manager=manager,
            log_samples=cfg.log_samples,
            bootstrap_iters=1000,
            **dict.fromkeys(SEEDS, cfg.seed),
        )
        per_task = {task: _metrics(values) for task, values in out["results"].items()}
        results[info.label] = {
            **info.identity(),
            "max_length": lm.max_length,
            "results": per_task,
            "n-shot": out.get("n-shot"),
            "versions": out.get("versions"),
        }
        for task, metrics in per_task.items():
            rows += [{"label": info.label, "task": task, "metric": m, "value": v} for m, v in metrics.items()]
        for task, docs in (out.get("samples") or {}).items():
            samples += [{"label": info.label, "task": task, **doc} for doc in docs]
    summary = {
        "tasks": tasks,
        "num_fewshot": cfg.num_fewshot,
        "limit": cfg.limit,
        "lm_eval": lm_eval.__version__,
        "seed": cfg.seed,
        "dtype": cfg.dtype,
        "checkpoints": results,
    }
    common.write_json(os.path.join(cfg.output_dir, RESULTS_NAME), summary)
    common.write_rows(os.path.join(cfg.output_dir, CSV_NAME), rows)
    if cfg.log_samples:
        common.write_jsonl(os.path.join(cfg.output_dir, SAMPLES_NAME), samples)
    return summary
