"""What a server says of its own load on ``/metrics`` (Prometheus text): requests running and
waiting, KV-cache use, preemptions — under vLLM's names (``infersight serve`` exports the
same), SGLang's or llama.cpp server's (``--metrics``). A server that exposes none of them reads
as ``None``: the workbench then says its queue and KV are not visible remotely."""

from __future__ import annotations

import math
from dataclasses import dataclass

import httpx2
from prometheus_client.parser import text_string_to_metric_families

from app.endpoints.client import Endpoint, headers, server_url

#: each figure's sample names, by server, first found wins (summed over labels: models)
NAMES: dict[str, tuple[str, ...]] = {
    "running": ("vllm:num_requests_running", "sglang:num_running_reqs",
                "llamacpp:requests_processing"),
    "waiting": ("vllm:num_requests_waiting", "sglang:num_queue_reqs",
                "llamacpp:requests_deferred"),
    # a fraction 0…1 in each (vLLM's name before v0.10: gpu_cache_usage_perc)
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage",
                 "llamacpp:kv_cache_usage_ratio"),
    "preemptions": ("vllm:num_preemptions_total",),
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class ServerGauges:
    """A server's own figures (NaN: it does not export that one)."""

    running: float = math.nan
    waiting: float = math.nan
    kv_usage: float = math.nan  # 0…1
    preemptions: float = math.nan  # since the server started


def samples(text: str) -> dict[str, float]:
    """Each sample's value in a ``/metrics`` page by name, summed over its labels (models);
    raises ValueError where the page is not Prometheus text."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[sample.name] = found.get(sample.name, 0.0) + float(sample.value)
    return found


def parse(text: str) -> ServerGauges | None:
    """The figures in a ``/metrics`` page (None: none of :data:`NAMES`, or not Prometheus)."""
    try:
        read = samples(text)
    except ValueError:  # not Prometheus text
        return None
    found = {}
    for figure, names in NAMES.items():
        value = next((read[n] for n in names if n in read), None)
        if value is not None:
            found[figure] = value
    return ServerGauges(**found) if found else None


def scrape(endpoint: Endpoint, client: httpx2.Client) -> ServerGauges | None:
    """``GET /metrics`` on ``endpoint``'s server (None: it has no such page, or nothing of
    :data:`NAMES` on it, or it did not answer)."""
    try:
        response = client.get(server_url(endpoint.base_url) + "/metrics",
                              headers=headers(endpoint), timeout=5.0)  # fmt: skip
    except httpx2.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return parse(response.text)
