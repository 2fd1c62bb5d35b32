"""The instruments' view of one metrics snapshot: memory by kind (a GPU's or the process's,
each rank's of a split model), the KV pool block by block, throughput, per-layer timings and
speculative decoding's figures, as :class:`widgets.instruments.InstrumentFrame` takes them."""

from __future__ import annotations

from engine.core.metrics import MetricsSnapshot
from widgets.instruments import InstrumentFrame


def frame_of(s: MetricsSnapshot) -> InstrumentFrame:
    mem = s.memory
    mib = 2**-20
    memory = {
        "weights": mem.weights_bytes * mib,
        "KV pool": mem.kv_pool_bytes * mib,
        # of the pool: blocks held by requests, and free blocks keeping a cached prefix
        "KV in use": (
            s.kv_blocks_used * s.kv_block_bytes + s.kv_local_blocks_used * s.kv_local_block_bytes
        )
        * mib,
        "KV cached (reusable)": s.kv_blocks_cached * s.kv_block_bytes * mib,
    }
    if mem.workspace_bytes is not None:
        memory["workspace"] = mem.workspace_bytes * mib
    if mem.cuda_reserved_bytes is not None:  # a GPU model: the GPU's memory, not the host's
        # reserved is what runs out first; NVML adds the context and other processes
        memory["CUDA reserved"] = mem.cuda_reserved_bytes * mib
        if mem.nvml_used_bytes is not None:
            memory["GPU used (NVML)"] = mem.nvml_used_bytes * mib
        if mem.nvml_total_bytes is not None:
            memory["GPU total (NVML)"] = mem.nvml_total_bytes * mib
    elif mem.process_rss_bytes is not None:
        memory["process RSS"] = mem.process_rss_bytes * mib
    # a split model: each rank's own (its GPU's use, or its process's resident set)
    what = "GPU used" if mem.cuda_reserved_bytes is not None else "RSS"
    for rank, used in enumerate(mem.rank_bytes):
        if used is not None:
            memory[f"rank {rank} {what}"] = used * mib
    return InstrumentFrame(
        t=s.time,
        memory_mib=memory,
        kv_usage=s.kv_cache_usage_perc,
        kv_blocks_used=s.kv_blocks_used,
        kv_blocks_total=s.kv_blocks_total,
        block_owners=s.kv_block_owners,
        block_cached=s.kv_block_cached,
        kv_blocks_cached=s.kv_blocks_cached,
        kv_blocks_shared=s.kv_blocks_shared,
        prefix_hit_rate=s.prefix_cache_hit_rate if s.prefix_caching else None,
        generation_tps=s.generation_throughput_tps,
        layer_attention_ms=tuple(t.attention_s * 1e3 for t in s.layer_timings),
        layer_mlp_ms=tuple(t.mlp_s * 1e3 for t in s.layer_timings),
        speculative=s.speculative,
        spec_draft_tokens_per_pos=s.spec_decode_num_draft_tokens_per_pos,
        spec_acceptance_per_pos=s.spec_decode_acceptance_per_pos,
        spec_acceptance_rate=s.spec_decode_acceptance_rate,
        spec_mean_acceptance_length=s.spec_decode_mean_acceptance_length,
        spec_draft_s=s.spec_decode_draft_time_seconds,
        spec_verify_s=s.spec_decode_verify_time_seconds,
        expert_layers=s.expert_layers,
        expert_tokens=s.expert_tokens,
    )
