"""Options a plugin declares: flags of ``mega train`` and a ``[plugin-name]`` table of its TOML.

A registration may carry ``options=``, a dataclass whose fields are declared with
:func:`mega.core.config.option` exactly as the core's sections are (or an import path to one)::

    @dataclass
    class LossCsvOptions:
        loss_csv: str | None = option(None, "write each step's loss to this CSV file")

    register("loss-csv", make_listener, options=LossCsvOptions)

``mega train`` then has ``--loss-csv`` (listed under the plugin's name in ``--help``) and reads a
``[loss_csv]`` table (the plugin's entry-point name) from ``--config``, with the core's
validation; the parsed instance is ``run_config.plugins["loss_csv"]``.
"""

from __future__ import annotations

import dataclasses

from mega.core.config.options import flag_of
from mega.core.plugins.registry import resolve


def option_sections(plugins, taken_flags: set[str], taken_sections: set[str]) -> dict[str, tuple[type, str]]:
    """``{plugin name: (options class, help title)}`` for every loaded plugin that declares options.

    A plugin whose options cannot be added (two different classes, a flag or table name the core
    or an earlier plugin has, a class that does not import) is recorded as failed to load, so
    ``mega train`` stops naming it, as for any plugin that failed; the others keep their flags.
    """
    infos = {info.name: info for info in plugins.infos}
    declared: dict[str, list] = {}
    for registry in plugins.registries.values():
        for entry in registry.entries():
            for registration in (entry, *entry.contested_by):
                if registration.options is not None:
                    declared.setdefault(registration.plugin, []).append(registration)
    sections: dict[str, tuple[type, str]] = {}
    flags = set(taken_flags)
    for plugin, registrations in sorted(declared.items()):
        info = infos.get(plugin)
        try:
            cls = _one_class(plugin, registrations)
            _check_free(plugin, cls, flags, taken_sections | set(sections))
        except Exception as error:  # noqa: BLE001 - any failure is the plugin's, and reported as such
            if info is not None:
                info.error = "; ".join(filter(None, [info.error, f"its options: {error}"]))
            continue
        flags |= {flag_of(field) for field in dataclasses.fields(cls) if field.init}
        first = registrations[0]
        sections[plugin] = (cls, f"plugin {plugin} ({first.distribution})")
    return sections


def _one_class(plugin: str, registrations: list) -> type:
    classes = {id(cls): cls for cls in (resolve(r.options) for r in registrations)}
    if len(classes) > 1:
        names = ", ".join(sorted(c.__name__ for c in classes.values()))
        raise ValueError(f"plugin {plugin} declares {len(classes)} option classes ({names}); "
                         "its [table] holds one: declare one class and pass it to each registration")
    cls = next(iter(classes.values()))
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"options={cls!r} is not a dataclass of option() fields")
    return cls


def _check_free(plugin: str, cls: type, flags: set[str], sections: set[str]) -> None:
    if plugin in sections:
        raise ValueError(f"its table [{plugin}] is a section mega train already has")
    if "." in plugin:
        raise ValueError(f"the entry-point name {plugin!r} cannot name a TOML table (it has a dot)")
    for field in dataclasses.fields(cls):
        if field.init and flag_of(field) in flags:
            raise ValueError(f"{flag_of(field)} ({cls.__name__}.{field.name}) is a flag mega train already has")
