"""The one selector of implementations (diffmeg.registry): what the config, the flags, `auto`, the
builders and the docs read from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffmeg import registry
from diffmeg.errors import DiffmegError

DOC = Path(__file__).resolve().parents[1] / "docs" / "implementations.md"


def test_the_docs_table_is_the_registry():
    assert registry.markdown_table() in DOC.read_text(), (
        "docs/implementations.md differs from diffmeg/registry.py: paste registry.markdown_table()"
    )


def test_every_slot_has_implementations_unique_names_and_an_auto_order_of_its_own():
    for slot in registry.SLOTS:
        names = registry.names(slot.name)
        assert names and len(set(names)) == len(names), slot.name
        assert set(registry.AUTO_ORDER[slot.name]) <= set(names), slot.name
    assert set(registry.AUTO_ORDER) == {s.name for s in registry.SLOTS}
    assert {i.slot for i in registry.IMPLEMENTATIONS} == {s.name for s in registry.SLOTS}


def test_every_implementation_that_can_run_here_loads():
    for impl in registry.IMPLEMENTATIONS:
        if impl.missing(None) is None:
            assert callable(impl.load()), f"{impl.slot}/{impl.name}"


def test_auto_is_the_measured_choice_and_names_are_checked():
    assert registry.resolve("diff_attention") == "sdpa"
    assert registry.select("diff_attention", "auto", "cpu").name == "sdpa"
    with pytest.raises(DiffmegError, match="unknown differential attention backend 'te'.*choose one of auto"):
        registry.check_name("diff_attention", "te")
    with pytest.raises(DiffmegError, match="no implementation slot 'linear'"):
        registry.names("linear")


def test_the_flag_and_the_config_accept_the_registry_names():
    from diffmeg.training.arguments import build_parser
    from tests.builders import make_config

    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "diff_attn_backend")
    assert tuple(action.choices) == registry.choices("diff_attention")
    for name in registry.choices("diff_attention"):
        assert make_config(attention_backend_diff=name).attention_backend_diff == name


def test_a_spec_takes_the_first_runnable_entry_of_its_own_family():
    assert registry.select("norm", spec="local").name == "local"
    assert registry.select("core_attention", spec="local").load().__name__ == "SDPACoreAttention"
    with pytest.raises(DiffmegError, match="unknown layer spec 'apex'"):
        registry.resolve("norm", spec="apex")
    if registry.implementation("norm", "transformer_engine").missing(None) is not None:
        with pytest.raises(DiffmegError, match="norm needs transformer_engine and a CUDA GPU"):
            registry.select("norm", spec="transformer_engine")


def test_fused_candidates_are_by_name_only_and_their_flags_and_fields_are_checked():
    """Issue 30's candidates wait for a GPU measurement: `auto` keeps the eager paths on every device."""
    from diffmeg.training.arguments import build_parser
    from tests.builders import make_config

    assert registry.resolve("norm", spec="local") == "local" and registry.resolve("loss") == "megatron"
    parser = build_parser()
    flags = {a.dest: a for a in parser._actions}
    assert tuple(flags["norm_impl"].choices) == ("auto", "local", "torch")
    unknown = r"unknown norm 'compiled' \(not available in this build\); choose one of auto, local, torch"
    with pytest.raises(DiffmegError, match=unknown):
        make_config(norm_impl="compiled")
    with pytest.raises(DiffmegError, match="norm_impl 'transformer_engine' is the Transformer Engine spec's"):
        make_config(norm_impl="transformer_engine")
