"""docs/plugins.md states every hook's signature and the registry's public API; the code is the
judge: each documented signature must be hookspecs.py's, and each public member documented."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from mega.core.plugins import Plugins, hookspecs
from mega.core.plugins.registry import Entry, Registry
from mega.train.trainer import RunState

DOC = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"
HOOK_ROW = re.compile(r"^\| `((?:register_|on_)\w+|forward_context)\(([^)]*)\)`", re.M)
API = re.compile(r"`(Plugins|Registry|Entry)\.(\w+)(\(?)")
RUN_ATTRIBUTE = re.compile(r"^\| `run\.(\w+)`(?:, `run\.(\w+)`)?", re.M)


def documented_hooks(text: str) -> dict[str, list[str]]:
    """``{hook: [argument names]}`` from the rows ``| `hook(a, b)` |`` of the page."""
    return {name: [a.strip() for a in arguments.split(",") if a.strip()] for name, arguments in HOOK_ROW.findall(text)}


def specified_hooks(*spec_classes: type) -> dict[str, list[str]]:
    """``{hook: [argument names]}`` of the hookspec classes (``self`` left out)."""
    return {name: list(inspect.signature(function).parameters)[1:]
            for cls in spec_classes for name, function in vars(cls).items()
            if callable(function) and not name.startswith("_")}


def drift(documented: dict[str, list[str]], specified: dict[str, list[str]]) -> list[str]:
    problems = [f"{name}: not documented" for name in specified if name not in documented]
    problems += [f"{name}: documented but no such hook" for name in documented if name not in specified]
    problems += [f"{name}({', '.join(documented[name])}) documented, hookspecs.py has {name}({', '.join(args)})"
                 for name, args in specified.items() if name in documented and documented[name] != args]
    return problems


SPECS = (hookspecs.RegistrationSpecs, hookspecs.EventSpecs)


def test_every_hook_is_documented_with_its_signature():
    assert drift(documented_hooks(DOC.read_text(encoding="utf-8")), specified_hooks(*SPECS)) == []
    assert "on_step_end" in documented_hooks(DOC.read_text(encoding="utf-8"))  # the rows are found at all


def test_a_changed_signature_or_hook_without_the_page_is_caught():
    text = DOC.read_text(encoding="utf-8")
    # The page changed alone:
    edited = text.replace("`on_step_end(run, iteration, metrics)`", "`on_step_end(run, iteration)`")
    assert drift(documented_hooks(edited), specified_hooks(*SPECS)) == [
        "on_step_end(run, iteration) documented, hookspecs.py has on_step_end(run, iteration, metrics)"]

    # The code changed alone: a copy of the event specs with one more argument and a new hook.
    class ChangedEventSpecs(hookspecs.EventSpecs):
        @hookspecs.hookspec
        def on_eval(self, run, iteration, metrics, split):
            """(changed)"""

        @hookspecs.hookspec
        def on_new_event(self, run):
            """(new)"""

    changed = {**specified_hooks(*SPECS), **specified_hooks(ChangedEventSpecs)}
    assert sorted(drift(documented_hooks(text), changed)) == [
        "on_eval(run, iteration, metrics) documented, hookspecs.py has on_eval(run, iteration, metrics, split)",
        "on_new_event: not documented"]


def public_members(cls: type) -> set[str]:
    names = {name for name in vars(cls) if not name.startswith("_")}
    if dataclasses.is_dataclass(cls):
        names |= {field.name for field in dataclasses.fields(cls) if not field.name.startswith("_")}
    instance_attributes = re.findall(r"self\.([a-z]\w*)\s*(?::[^=]*)?=", inspect.getsource(cls.__init__)) \
        if "__init__" in vars(cls) and not dataclasses.is_dataclass(cls) else []
    return names | set(instance_attributes)


@pytest.mark.parametrize("cls", [Plugins, Registry, Entry])
def test_the_registry_api_is_documented_and_exists(cls):
    documented = {member for owner, member, _ in API.findall(DOC.read_text(encoding="utf-8")) if owner == cls.__name__}
    public = public_members(cls) - {"manager"}  # the pluggy manager is an implementation detail
    assert sorted(public - documented) == [], f"{cls.__name__}: public but not in docs/plugins.md"
    assert sorted(documented - public) == [], f"{cls.__name__}: in docs/plugins.md but not in the code"


def test_every_documented_run_attribute_exists():
    documented = {name for pair in RUN_ATTRIBUTE.findall(DOC.read_text(encoding="utf-8")) for name in pair if name}
    existing = {field.name for field in dataclasses.fields(RunState)} | {
        name for name, value in vars(RunState).items() if isinstance(value, property)}
    assert documented and sorted(documented - existing) == []
    assert sorted(existing - documented) == []
