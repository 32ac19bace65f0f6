"""The table of implementations (diffmeg.registry): its rows load and check in one line, and the flags, the
run configuration, args.json's defaults, the campaign's levers and the docs follow from it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from diffmeg import registry
from diffmeg.errors import DiffmegError

DOC = Path(__file__).resolve().parents[1] / "docs" / "implementations.md"
SMALL = ["--model", "diff-tiny", "--mock-data", "--train-iters", "1"]


def test_the_docs_tables_are_the_registry():
    assert registry.markdown_tables() in DOC.read_text(), (
        "docs/implementations.md differs from diffmeg/registry.py: paste registry.markdown_tables()"
    )


def test_every_slot_has_rows_of_unique_names_and_an_auto_order_of_its_own():
    for slot in registry.SLOTS:
        names = registry.names(slot.name)
        assert names and len(set(names)) == len(names), slot.name
        assert slot.auto and set(slot.auto) <= set(names), slot.name
        levers = [e for e in registry.entries(slot.name) if e.lever]
        assert not levers or slot.flag and not {e.name for e in levers} & set(slot.auto), slot.name
    assert {e.slot for e in registry.ENTRIES} == {s.name for s in registry.SLOTS}
    assert all(
        re.fullmatch(r"[\w.]+:\w+", path) for e in registry.ENTRIES for path in (e.target, e.check or "a:b")
    )


def test_every_row_that_can_run_here_imports_a_callable():
    for e in registry.ENTRIES:
        if e.unavailable() is None:
            assert callable(e.load()), f"{e.slot}/{e.name}"


def _nothing_installed(monkeypatch) -> None:
    """Every check's fault at once: no CUDA, no TE or torchao, and megatron-core stepping a fused Adam of
    its own."""
    import torch

    from diffmeg import runtime
    from diffmeg.fusions import optimizer_step, torchao_fp8

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for module, name, value in (
        (runtime, "transformer_engine_available", False),
        (torchao_fp8, "torchao_available", False),
        (optimizer_step, "megatron_has_fused_adam", True),
    ):
        monkeypatch.setattr(module, name, lambda value=value: value)


@pytest.mark.parametrize("installed", [True, False], ids=["as-installed", "nothing-installed"])
def test_every_check_answers_none_or_one_line_naming_the_way_out(installed, monkeypatch):
    if not installed:
        _nothing_installed(monkeypatch)
    refused = 0
    for e in registry.ENTRIES:
        for device_type in (None, "cpu", "cuda"):
            reason = e.unavailable(device_type)
            if reason is None:
                continue
            refused += 1
            assert isinstance(reason, str) and "\n" not in reason, (e.name, device_type, reason)
            assert re.search(r"\b(use|leave out)\b", reason), (e.name, device_type, reason)
            if device_type is None:
                with pytest.raises(DiffmegError, match=re.escape(reason)):
                    registry.select(e.slot, e.name)
    assert refused  # CPU: the GPU SDPA kernels are refused for CPU tensors at least
    if not installed:
        checked = [e for e in registry.ENTRIES if e.check]
        assert all(e.unavailable(None) or e.unavailable("cpu") for e in checked)


def test_the_targets_stand_below_the_registry():
    """The registry imports its rows' modules by name only (importlib), which the floors' test cannot see:
    none of them may reach the registry or the model config back, whatever it imports on the way."""
    from tests.test_architecture import REPO_ROOT, find_modules, read_imports

    graph = read_imports(find_modules(REPO_ROOT, ("diffmeg",)))
    for e in registry.ENTRIES:
        for path in (e.target, e.check):
            module = (path or "").partition(":")[0]
            if module not in graph.modules:
                continue  # torch's, megatron-core's, the standard library's
            seen, todo = set(), [module]
            while todo:
                for imported in graph.imports.get(todo.pop(), {}):
                    if imported not in seen:
                        seen.add(imported)
                        todo.append(imported)
            assert not seen & {"diffmeg.registry", "diffmeg.config"}, (
                f"{path} imports {seen & {'diffmeg.registry', 'diffmeg.config'}}"
            )


def test_auto_is_the_measured_choice_and_names_are_checked():
    assert registry.resolve("diff_attention") == "sdpa"
    assert registry.select("diff_attention", "auto", "cpu").name == "sdpa"
    with pytest.raises(DiffmegError, match="unknown differential attention backend 'te'.*choose one of auto"):
        registry.check_name("diff_attention", "te")
    with pytest.raises(DiffmegError, match="no implementation slot 'linear'"):
        registry.names("linear")


def test_a_spec_takes_the_first_runnable_entry_of_its_own_family():
    assert registry.select("norm", spec="local").name == "local"
    assert registry.select("core_attention", spec="local").load().__name__ == "SDPACoreAttention"
    with pytest.raises(DiffmegError, match="unknown layer spec 'apex'"):
        registry.resolve("norm", spec="apex")
    if registry.entry("norm", "transformer_engine").unavailable() is not None:
        with pytest.raises(
            DiffmegError, match="^the Transformer Engine spec needs transformer_engine and a CUDA"
        ):
            registry.select("norm", spec="transformer_engine")


def test_the_gpu_candidates_wait_for_a_measurement_and_are_checked_by_name():
    """The levers' rows are choices by name: `auto` keeps the eager paths on every device until the lever
    matrix has timed them on a GPU."""
    from tests.builders import make_config

    assert registry.resolve("norm", spec="local") == "local" and registry.resolve("optimizer") == "megatron"
    assert registry.resolve("sdpa_kernel") == "torch"
    unknown = r"unknown norm 'compiled' \(not available in this build\); choose one of auto, local, torch$"
    with pytest.raises(DiffmegError, match=unknown):
        make_config(norm_impl="compiled")
    with pytest.raises(DiffmegError, match="^norm 'transformer_engine' is the Transformer Engine spec's own"):
        make_config(norm_impl="transformer_engine")


@pytest.mark.parametrize("name", ["flash", "flex"])
def test_a_backend_that_left_is_refused_in_one_line_saying_so(name, monkeypatch, capsys):
    """flash and flex left (no measurement picked them): the command line refuses them among its choices,
    and a saved args.json naming one reads as one line saying it left and where git keeps it."""
    from diffmeg import model
    from diffmeg.checkpoints import single_rank_args
    from diffmeg.run_config import RunConfig
    from diffmeg.training.arguments import resolve_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = ["--model", "diff-tiny", "--mock-data"]
    with pytest.raises(SystemExit):
        resolve_args([*argv, "--diff-attn-backend", name])
    assert f"invalid choice: '{name}'" in capsys.readouterr().err
    saved = {**vars(resolve_args(argv)), "diff_attn_backend": name}
    left = (
        f"^differential attention backend '{name}' left the package \\(no measurement picked it; git keeps "
        f"it at {registry.RETIRED_AT}\\); choose one of auto, reference, sdpa,"
    )
    with pytest.raises(DiffmegError, match=left):
        model.transformer_config(RunConfig.from_args(single_rank_args(saved), partial=True))


def test_each_flag_offers_its_slots_choices_and_reaches_the_run_config():
    from diffmeg.checkpoints import SAVED_ARGS_DEFAULTS
    from diffmeg.run_config import RunConfig
    from diffmeg.training.arguments import build_parser, resolve_args

    actions = {a.dest: a for a in build_parser()._actions}
    for slot in registry.flagged():
        assert tuple(actions[slot.field].choices) == registry.choices(slot.name), slot.flag
        assert (
            actions[slot.field].default == registry.AUTO and SAVED_ARGS_DEFAULTS[slot.field] == registry.AUTO
        )
    assert "transformer_engine" not in actions["norm_impl"].choices  # the TE spec chooses its own
    run = RunConfig.from_args(resolve_args([*SMALL, "--norm-impl", "torch"], world_size=1))
    assert run.impls == {"diff_attn_backend": "auto", "sdpa_backend": "auto", "norm_impl": "torch",
                         "optimizer_impl": "auto"}  # fmt: skip
    assert vars(run.to_args())["norm_impl"] == "torch"
    old = RunConfig.from_args({"num_layers": 2}, partial=True)  # an args.json before the flags
    assert set(old.impls.values()) == {"auto"} and "norm_impl" not in vars(old.to_args())


def test_a_row_added_to_the_table_is_a_choice_of_its_flag_the_config_and_the_campaign(monkeypatch):
    """A new lever is its module, its row and its test: the row alone makes it a choice."""
    from diffmeg.run_config import RunConfig
    from diffmeg.training.arguments import build_parser, resolve_args
    from tests.builders import make_config

    fast = registry.Entry("norm", "fast", "diffmeg.fusions.rms_norm:TorchRMSNorm", "a norm", spec="local",
                          lever="fast norm")  # fmt: skip
    rope = registry.Slot("rope", "rotary embedding", "RoPE", ("eager",), "a test", "--rope-impl")
    eager = registry.Entry("rope", "eager", "diffmeg.fusions.rms_norm:rms_norm", "the eager RoPE")
    monkeypatch.setattr(registry, "ENTRIES", (*registry.ENTRIES, fast, eager))
    monkeypatch.setattr(registry, "SLOTS", (*registry.SLOTS, rope))

    actions = {a.dest: a for a in build_parser()._actions}
    assert "fast" in actions["norm_impl"].choices and tuple(actions["rope_impl"].choices) == ("auto", "eager")
    assert make_config(norm_impl="fast").norm_impl == "fast"
    assert registry.select("norm", "fast", "cpu").load().__name__ == "TorchRMSNorm"
    assert ("fast norm", ("--norm-impl", "fast")) in registry.levers("norm")
    run = RunConfig.from_args(
        resolve_args([*SMALL, "--rope-impl", "eager", "--norm-impl", "fast"], world_size=1)
    )
    assert (run.impls["rope_impl"], run.impls["norm_impl"]) == ("eager", "fast")
    assert vars(run.to_args())["rope_impl"] == "eager"
    assert "`rope` | RoPE | `--rope-impl`" in registry.markdown_tables()


def test_every_lever_of_the_table_is_in_the_gpu_campaigns_matrix():
    """A row marked as a GPU candidate is timed: its flags are some lever's 'on' flags in the GPU plan (a
    slot the plan does not place yet fails here, not on a lent GPU)."""
    from benchmarks.campaign import plan

    gpu = plan.GPU_PLAN
    pulled = [flags for _, flags in gpu.train_fast]
    pulled += [("--diff-attn-backend", backend) for backend in gpu.train_backends]
    for slot in registry.SLOTS:
        for name, flags in registry.levers(slot.name):
            assert any(_contains(on, flags) for on in pulled), f"{slot.name}: {name} {flags}"


def _contains(flags: tuple[str, ...], pair: tuple[str, str]) -> bool:
    return any(flags[i : i + 2] == pair for i in range(len(flags) - 1))
