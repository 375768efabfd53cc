"""Plug-ins: compressors, data-path stages and collective algorithms that other distributions
register.

A distribution (a package you ``pip install``) adds names to the testbed's registries through
Python entry points, without editing the testbed::

    # the plug-in's pyproject.toml
    [project.entry-points."testbed.compressors"]
    absmax8 = "mycompressor:Absmax8Compressor"
    [project.entry-points."testbed.stages"]
    msgcount = "mystage:MsgCountStage"
    [project.entry-points."testbed.algorithms"]
    bintree = "myalgorithm:BinaryTree"

The entry point's name is the name experiments and program lists use; its value is the class
(a :class:`~testbed.kernels.compressors.base.Compressor`, a
:class:`~testbed.datapath.batch.Stage` or a
:class:`~testbed.collectives.algorithms.PeerAlgorithm` subclass). The registries
(:mod:`testbed.kernels.compressors`, :mod:`testbed.datapath.programs`,
:mod:`testbed.collectives.algorithms`) list built-ins and plug-ins together.

Reading the names costs one scan of the installed distributions' metadata (no plug-in is
imported); it is done once per process, :func:`refresh` scans again. A plug-in is imported
when it is first used. Nothing is skipped silently: a name registered twice, a plug-in that
takes a built-in's name, one that fails to import or is not the right kind of class raises
:class:`PluginError` naming the entry point and the distribution that declares it.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points

#: Entry-point group of compressors (name -> Compressor subclass).
COMPRESSORS_GROUP = "testbed.compressors"
#: Entry-point group of data-path stages (name -> Stage subclass).
STAGES_GROUP = "testbed.stages"
#: Entry-point group of collective algorithms (name -> PeerAlgorithm subclass).
ALGORITHMS_GROUP = "testbed.algorithms"


class PluginError(ValueError):
    """A plug-in cannot be used; the message names its entry point and distribution."""


@dataclass(frozen=True)
class Plugin:
    """One registered entry point: ``name = value`` of ``dist`` in ``group``."""

    group: str
    name: str
    value: str
    dist: str

    def describe(self) -> str:
        """``entry point 'name = module:Class' (group ...) of distribution 'dist x.y'``."""
        return (f"entry point '{self.name} = {self.value}' (group {self.group}) of "
                f"distribution '{self.dist}'")

    def load(self, base: type) -> type:
        """Import the plug-in's class and check it subclasses ``base`` (:class:`PluginError`
        otherwise: fix or uninstall the distribution)."""
        try:
            obj = EntryPoint(self.name, self.value, self.group).load()
        except Exception as e:  # any import-time failure of third-party code
            raise PluginError(f"{self.describe()} failed to load: {type(e).__name__}: {e}; "
                              f"fix it or uninstall that distribution") from e
        if not (isinstance(obj, type) and issubclass(obj, base)):
            raise PluginError(f"{self.describe()} gives {obj!r}, which is not a subclass of "
                              f"{base.__module__}.{base.__qualname__}")
        return obj


def _dist_label(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "(unknown distribution)"
    return f"{dist.metadata['Name']} {dist.version}"


@functools.cache
def _scan(group: str) -> tuple[Plugin, ...]:
    return tuple(Plugin(group, ep.name, ep.value, _dist_label(ep))
                 for ep in entry_points(group=group))


def plugins(group: str, builtins=()) -> dict[str, Plugin]:
    """Name -> :class:`Plugin` registered in ``group`` (scanned once per process).

    Raises :class:`PluginError` when two distributions register the same name, or a plug-in
    takes the name of one of ``builtins``.
    """
    found: dict[str, Plugin] = {}
    for p in _scan(group):
        if p.name in builtins:
            raise PluginError(f"{p.describe()} takes the name of a built-in; rename the entry "
                              f"point in that distribution's pyproject.toml, or uninstall it")
        if p.name in found and found[p.name] != p:
            raise PluginError(f"name {p.name!r} is registered twice: by {found[p.name].describe()}"
                              f" and by {p.describe()}; uninstall one of them")
        found[p.name] = p
    return found


def refresh() -> None:
    """Forget the scanned entry points, so the next lookup sees plug-ins installed since.

    A plug-in installed editable (``pip install -e``) becomes importable only in a new
    process (its path is added at interpreter start): restart the notebook kernel instead.
    """
    importlib.invalidate_caches()  # the metadata finder caches folder listings, too
    _scan.cache_clear()
