"""The plugin manager: discovery, registries, duplicates, unknown names, selection, failures."""

from __future__ import annotations

import types

import pytest

from mega.core.plugins import (
    Command,
    DuplicateNameError,
    PluginError,
    UnknownNameError,
    hookimpl,
    load_plugins,
)
from mega.core.plugins import manager as manager_module
from mega.core.plugins.manager import _Candidate


def make_plugin(**hooks):
    """A plugin object whose registration hooks register the given (name, obj) pairs."""
    namespace = types.SimpleNamespace()
    for hook_name, entries in hooks.items():

        def hook(register, _entries=entries):
            for name, obj in _entries:
                register(name, obj)

        hook.__name__ = hook_name
        setattr(namespace, hook_name, hookimpl(hook))
    return namespace


@pytest.fixture
def fake_entry_points(monkeypatch):
    """Replace installed entry points by the given candidates (core stays real)."""

    def install(*candidates):
        real = [c for c in manager_module._entry_point_candidates() if c.name == "core"]
        monkeypatch.setattr(manager_module, "_entry_point_candidates", lambda: real + list(candidates))

    return install


def candidate(name, plugin, distribution="mega-test", version="1.2.3"):
    return _Candidate(name, distribution, version, lambda: plugin)


def test_core_is_discovered_through_its_entry_point():
    plugins = load_plugins(environ={})
    core = next(info for info in plugins.infos if info.name == "core")
    assert core.distribution == "mega-core"
    assert "plugins" in core.registered["command"]
    assert plugins.commands.entry("plugins").origin.startswith("mega-core ")


def test_registered_objects_resolve_lazily_from_import_paths(fake_entry_points):
    fake_entry_points(candidate("demo", make_plugin(register_tokenizers=[("Path", "os.path:join")])))
    plugins = load_plugins(environ={})
    entry = plugins.tokenizers.entry("Path")
    assert entry._resolved is None  # nothing imported yet
    import os.path

    assert plugins.tokenizers.get("Path") is os.path.join


def test_duplicate_names_name_both_distributions(fake_entry_points):
    fake_entry_points(
        candidate("first", make_plugin(register_tokenizers=[("Same", object())]), "mega-a", "1.0"),
        candidate("second", make_plugin(register_tokenizers=[("Same", object())]), "mega-b", "2.0"),
    )
    plugins = load_plugins(environ={})
    first, second = (next(info for info in plugins.infos if info.name == name) for name in ("first", "second"))
    # The newcomer is marked, not the innocent first; neither failed to load.
    assert not first.duplicates and first.error is None and second.error is None
    assert "first by plugin 'first' (mega-a 1.0), then by plugin 'second' (mega-b 2.0)" in second.duplicates[0]
    assert "MEGA_DISABLE_PLUGINS=second" in second.duplicates[0]
    assert plugins.tokenizers.contested() == ["Same"] and plugins.contested() == [second]
    with pytest.raises(DuplicateNameError, match="registered twice.*mega-a 1.0.*mega-b 2.0"):
        plugins.tokenizers.get("Same")


def test_the_newcomer_is_the_distribution_installed_last(fake_entry_points):
    # Discovery sorts by install time, so a plugin named to sort first cannot take a name from an
    # older distribution.
    fake_entry_points(
        _Candidate("b-old", "mega-old", "1", lambda: make_plugin(register_models=[("gpt", object())]), 1.0),
        _Candidate("a-new", "mega-new", "1", lambda: make_plugin(register_models=[("gpt", object())]), 2.0),
    )
    plugins = load_plugins(environ={})
    assert [info.name for info in plugins.contested()] == ["a-new"]
    assert plugins.models.entries()[0].distribution == "mega-old"


def test_unknown_name_suggests_close_names_and_lists_installed(fake_entry_points):
    fake_entry_points(
        candidate(
            "toks",
            make_plugin(register_tokenizers=[("GPT2BPETokenizer", object()), ("NullTokenizer", object())]),
            "mega-data",
            "0.1.0",
        )
    )
    plugins = load_plugins(environ={})
    with pytest.raises(UnknownNameError) as raised:
        plugins.tokenizers.get("GPT2BPE")
    message = str(raised.value)
    assert message.startswith("no tokenizer 'GPT2BPE'; did you mean GPT2BPETokenizer")
    assert "installed: GPT2BPETokenizer (from mega-data 0.1.0), NullTokenizer (from mega-data 0.1.0)" in message


def test_unknown_name_with_nothing_installed_says_so():
    plugins = load_plugins(environ={"MEGA_LOAD_PLUGINS": ""})
    with pytest.raises(UnknownNameError, match="no model 'gpt'; no model is installed"):
        plugins.models.get("gpt")


def test_disable_and_load_selection(fake_entry_points):
    fake_entry_points(
        candidate("alpha", make_plugin(register_datasets=[("a", object())])),
        candidate("beta", make_plugin(register_datasets=[("b", object())])),
    )
    disabled = load_plugins(environ={"MEGA_DISABLE_PLUGINS": "alpha"})
    assert disabled.datasets.names() == ["b"] and disabled.disabled == ["alpha"]

    only = load_plugins(environ={"MEGA_LOAD_PLUGINS": "alpha"})
    assert only.datasets.names() == ["a"]
    # The core is never unloaded: the CLI's own commands live in it.
    assert "plugins" in only.commands


def test_a_plugin_that_fails_to_import_is_recorded_not_raised(fake_entry_points):
    def broken():
        raise ImportError("No module named 'missing_dependency'")

    fake_entry_points(_Candidate("broken", "mega-broken", "0.0.1", broken))
    plugins = load_plugins(environ={})
    failed = plugins.failed()
    assert [(f.name, f.distribution) for f in failed] == [("broken", "mega-broken")]
    assert "missing_dependency" in failed[0].error


def test_a_hook_that_raises_is_recorded_and_others_still_register(fake_entry_points):
    @hookimpl
    def register_models(register):
        raise RuntimeError("boom")

    ok = make_plugin(register_models=[("fine", object())])
    fake_entry_points(
        candidate("bad", types.SimpleNamespace(register_models=register_models)),
        candidate("ok", ok),
    )
    plugins = load_plugins(environ={})
    assert plugins.models.names() == ["fine"]
    bad = next(info for info in plugins.infos if info.name == "bad")
    assert bad.error == "register_models failed: RuntimeError: boom"


def test_a_target_that_fails_to_import_raises_a_plugin_error_naming_it():
    plugins = load_plugins(
        environ={"MEGA_LOAD_PLUGINS": ""},
        extra=[("x", make_plugin(register_models=[("ghost", "mega_no_such_module:family")]))],
    )
    with pytest.raises(PluginError, match="model 'ghost': plugin x \\(\\(local\\)\\) failed to load: ModuleNotFoundError"):
        plugins.models.get("ghost")


def test_an_unknown_name_names_the_plugins_that_failed_to_load(fake_entry_points, monkeypatch):
    def broken():
        raise ImportError("No module named 'missing_dependency'")

    fake_entry_points(_Candidate("relu", "mega-relu", "0.0.1", broken))
    plugins = load_plugins(environ={})
    monkeypatch.delenv("MEGA_PLUGIN_TRACEBACKS", raising=False)
    with pytest.raises(UnknownNameError) as raised:
        plugins.models.get("gpt-relu")
    assert str(raised.value).startswith("no model 'gpt-relu'; plugin relu (mega-relu) failed to load: "
                                        "ImportError: No module named 'missing_dependency'")
    monkeypatch.setenv("MEGA_PLUGIN_TRACEBACKS", "1")
    with pytest.raises(UnknownNameError, match="(?s)Traceback.*in broken"):
        plugins.models.get("gpt-relu")


def test_command_registration_roundtrip():
    command = Command(help="say hi", main=lambda argv: 0)
    plugins = load_plugins(environ={}, extra=[("x", make_plugin(register_commands=[("hi", command)]))])
    assert plugins.commands.get("hi") is command


def test_plugin_options_become_sections_and_a_taken_flag_fails_the_plugin_not_the_others():
    import dataclasses

    from mega.core.config import option
    from mega.core.plugins.options import option_sections

    @dataclasses.dataclass
    class Good:
        loss_csv_path: str | None = option(None, "where")

    @dataclasses.dataclass
    class Clashing:
        lr: float = option(1.0, "a flag the core has")

    def plugin(options):
        @hookimpl
        def register_callbacks(register):
            register("cb", lambda run_config: None, options=options)
        return types.SimpleNamespace(register_callbacks=register_callbacks)

    plugins = load_plugins(environ={"MEGA_LOAD_PLUGINS": ""},
                           extra=[("good", plugin(Good)), ("clash", plugin(Clashing))])
    sections = option_sections(plugins, taken_flags={"--lr"}, taken_sections={"training"})
    assert sections == {"good": (Good, "plugin good ((local))")}
    clash = next(info for info in plugins.infos if info.name == "clash")
    assert clash.error == "its options: --lr (Clashing.lr) is a flag mega train already has"
