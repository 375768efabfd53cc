"""The data path's ``impair`` stage under a second name, for ingress impairment.

A link whose only programmable end is node P is impaired in both directions by P: an egress
``impair`` stage (after ``forward``) for P -> peer, and an ingress one (first in the pipeline)
for peer -> P. The engine addresses stages and their counters by name, so the ingress
instance needs its own: ``impair_ingress``. Loaded by the engine as
``testbed.topologies.impair_stages:IngressImpairStage``.
"""

from __future__ import annotations

from testbed.datapath.impair import ImpairStage


class IngressImpairStage(ImpairStage):
    """:class:`~testbed.datapath.impair.ImpairStage` fixed to ``direction='ingress'``."""

    name = "impair_ingress"

    def __init__(self, ports=None, **settings):
        settings.pop("direction", None)  # always ingress: that is the point of this class
        super().__init__(ports=ports, direction="ingress", **settings)


#: program name the engine resolves to this class
INGRESS_PROGRAM = "testbed.topologies.impair_stages:IngressImpairStage"
