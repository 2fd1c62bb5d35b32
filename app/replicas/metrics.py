"""Every replica's ``/metrics`` in one Prometheus exposition, each sample labelled with its
replica: what the front serves at ``/metrics`` (vLLM's names, as one server's). Ray's own
metrics (``ray_serve_*``) are on Ray's metrics port beside them."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

#: the label naming a sample's replica
LABEL = "replica"


class _Merged(Collector):
    def __init__(self, reports: Mapping[str, str]) -> None:
        self.reports = reports

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for replica, text in sorted(self.reports.items()):
            for family in text_string_to_metric_families(text):
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                for s in family.samples:
                    merged.add_sample(
                        s.name, {**s.labels, LABEL: replica}, s.value, s.timestamp, s.exemplar
                    )
        yield from families.values()


def merge(reports: Mapping[str, str]) -> bytes:
    """One exposition of ``reports`` (replica → its Prometheus text), each of a replica's
    samples given the label ``replica``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(reports))
    return generate_latest(registry)
