"""The data path's program registry: stage names, how a program list is written, name checks.

A program list names the stages a node's engine runs, in order: ``["forward"]``,
``[("aggregate", {...}), ("forward", {})]`` or ``[{"name": "trim", "settings": {...}}]``. A name
is a built-in (a key of :data:`STAGES`), a plug-in's (the entry-point group ``testbed.stages``
of an installed distribution, see docs/extending.md) or a ``"package.module:Class"`` string.
Resolving a name to its class (:func:`stage_class`) imports the stage's module, and with it
Numba; nothing else here does (plug-in names come from their metadata), so pipeline
composition (``testbed.topologies.pipeline``) and node classes can check a program list
without loading any kernel.
"""

from __future__ import annotations

import importlib

from testbed.datapath.batch import Stage
from testbed.kernels.plugins import STAGES_GROUP, PluginError, plugins

#: built-in program name -> "module:Class"
STAGES: dict[str, str] = {
    "forward": "testbed.datapath.forward:ForwardStage",
    "wire": "testbed.datapath.forward:WireStage",
    "aggregate": "testbed.datapath.aggregate:AggregateStage",
    "trim": "testbed.datapath.trim:TrimStage",
    "shape": "testbed.datapath.trim:ShapeStage",
    "impair": "testbed.datapath.impair:ImpairStage",
    "impair_ingress": "testbed.datapath.impair:IngressImpairStage",
    "nic_codec": "testbed.datapath.codec:CodecStage",
}


def stage_names() -> tuple[str, ...]:
    """Program names a list may use: the built-ins, then the plug-ins' (sorted).

    Reads the plug-ins' metadata only; :class:`~testbed.kernels.plugins.PluginError` when a
    plug-in's name is taken twice.
    """
    return tuple(STAGES) + tuple(sorted(plugins(STAGES_GROUP, STAGES)))


def check_program_name(name: str) -> str:
    """Return ``name`` if it is a built-in or plug-in program or a ``module:Class`` path, else
    raise ``ValueError`` listing the known names."""
    if not isinstance(name, str):
        raise ValueError(f"program name {name!r} must be a string")
    names = stage_names()  # raises on a plug-in that takes a built-in's name
    if name in names or ":" in name:
        return name
    raise ValueError(f"unknown program {name!r}; known: {', '.join(names)} "
                     "(or give 'package.module:Class')")


def stage_class(name: str) -> type:
    """Resolve a program name (or ``module:Class``) to its Stage class (imports its module)."""
    check_program_name(name)
    if name not in STAGES and ":" not in name:
        plugin = plugins(STAGES_GROUP, STAGES)[name]
        cls = plugin.load(Stage)
        if cls.name != name:  # counters and the control channel key stages by cls.name
            raise PluginError(f"{plugin.describe()}: the class says name = {cls.name!r}; the "
                              "entry point's name and the Stage's name must be the same")
        return cls
    target = STAGES.get(name, name)
    mod, _, cls = target.partition(":")
    try:
        obj = getattr(importlib.import_module(mod), cls)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"program {name!r}: cannot load {target} ({e})") from None
    if not (isinstance(obj, type) and issubclass(obj, Stage)):
        raise ValueError(f"program {name!r}: {target} is not a Stage subclass")
    return obj


def normalize_programs(programs) -> list[tuple[str, dict]]:
    """Accept ``[("forward", {...})]``, ``[{"name": "forward", "settings": {...}}]`` or names;
    return ``[(name, settings), ...]`` with fresh settings dicts and checked names."""
    out = []
    for p in programs or []:
        if isinstance(p, str):
            out.append((p, {}))
        elif isinstance(p, dict):
            if "name" not in p:
                raise ValueError(f"program entry {p!r} has no 'name'")
            out.append((p["name"], dict(p.get("settings") or {})))
        elif isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str):
            out.append((p[0], dict(p[1] or {})))
        else:
            raise ValueError(f"program entry {p!r}: use (name, settings) or "
                             "{'name': ..., 'settings': {...}}")
        check_program_name(out[-1][0])
    if not out:
        raise ValueError("no programs configured; give at least one, e.g. ['forward']")
    return out
