"""Launch settings for real KV tiers that keep speculative prefixes in spare evaluation-GPU memory: LMCache,
Mooncake Store (vLLM connectors) and SGLang HiCache. Pure functions returning dicts, flags and environment
variables; nothing is vendored, imported or run here (the simulated tier is `kvtier.py`).
"""

from __future__ import annotations

import json

__all__ = [
    "lmcache_config",
    "lmcache_env",
    "lmcache_vllm_args",
    "mooncake_store_config",
    "mooncake_store_vllm_args",
    "sglang_hicache_args",
    "vllm_kv_transfer_args",
]


# Config emitters for real tiers. Flag and key names follow specgen.md §4, checked against: vLLM docs
# features/mooncake_store_connector_usage (v0.28.0 and latest; v0.21.0 has no `mode` key), the vLLM/LMCache
# example and NVIDIA Dynamo's LMCache page (LMCache 0.5.x keys), and docs.sglang.io
# advanced_features/hicache_best_practices (SGLang 0.5.x). None of them is exercised here.


def vllm_kv_transfer_args(connector: str, role: str = "kv_both") -> list[str]:
    """`vllm serve` flags selecting a KV connector, e.g. ["--kv-transfer-config", '{"kv_connector":...}']."""
    if role not in ("kv_both", "kv_producer", "kv_consumer"):
        raise ValueError(f"role={role!r}: pass 'kv_both', 'kv_producer' or 'kv_consumer'")
    config = {"kv_connector": connector, "kv_role": role}
    return ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]


def lmcache_vllm_args() -> list[str]:
    """`vllm serve M --kv-transfer-config '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}'`."""
    return vllm_kv_transfer_args("LMCacheConnectorV1")


def lmcache_config(
    *,
    chunk_size: int = 256,
    local_cpu: bool = True,
    max_local_cpu_size_gb: float = 5.0,
    remote_url: str | None = None,
    use_layerwise: bool = False,
) -> dict[str, object]:
    """LMCache YAML keys (`LMCACHE_CONFIG_FILE`). `remote_url` (e.g. `lm://<eval-host>:65432` for an LMCache
    server on an evaluation host) appears only when given; the other keys always do."""
    if chunk_size <= 0 or max_local_cpu_size_gb < 0:
        raise ValueError(
            f"chunk_size={chunk_size}, max_local_cpu_size_gb={max_local_cpu_size_gb}: pass > 0, >= 0"
        )
    config: dict[str, object] = {"chunk_size": chunk_size, "local_cpu": local_cpu}
    config |= {"max_local_cpu_size": max_local_cpu_size_gb, "use_layerwise": use_layerwise}
    return config | ({"remote_url": remote_url} if remote_url is not None else {})


def lmcache_env(config: dict[str, object]) -> dict[str, str]:
    """The same settings as environment variables: LMCACHE_CHUNK_SIZE=256, LMCACHE_LOCAL_CPU=True, ..."""
    return {f"LMCACHE_{key.upper()}": str(value) for key, value in config.items()}


def mooncake_store_config(
    master_address: str,
    global_segment_size: str | int = "80GB",
    local_buffer_size: str | int = "4GB",
    protocol: str = "rdma",
    *,
    device_name: str = "",
    metadata_server: str = "P2PHANDSHAKE",
) -> dict[str, object]:
    """The JSON file `MOONCAKE_CONFIG_PATH` points at. Each rank contributes `global_segment_size` to the
    shared pool ("embedded" mode): on an evaluation host, that is its spare memory lent as KV tier."""
    if ":" not in master_address:
        raise ValueError(f"master_address={master_address!r}: pass mooncake_master's host:port")
    if protocol not in ("rdma", "tcp"):
        raise ValueError(f"protocol={protocol!r}: pass 'rdma' (fast) or 'tcp' (fallback)")
    return {
        "mode": "embedded",
        "metadata_server": metadata_server,
        "master_server_address": master_address,
        "global_segment_size": global_segment_size,
        "local_buffer_size": local_buffer_size,
        "protocol": protocol,
        "device_name": device_name,
    }


def mooncake_store_vllm_args() -> list[str]:
    """`MOONCAKE_CONFIG_PATH=cfg.json vllm serve M --kv-transfer-config
    '{"kv_connector":"MooncakeStoreConnector","kv_role":"kv_both"}'`; the file is `mooncake_store_config`."""
    return vllm_kv_transfer_args("MooncakeStoreConnector")


def sglang_hicache_args(
    *,
    page_size: int = 64,
    hicache_ratio: float = 2.0,
    hicache_size_gb: float | None = None,
    write_policy: str = "write_through",
    io_backend: str = "kernel",
    storage_backend: str | None = None,
    mem_layout: str = "page_first",
) -> list[str]:
    """`python -m sglang.launch_server` flags for HiCache (GPU -> host -> optional storage backend such as
    `mooncake`, `hf3fs` or `nixl`). `hicache_size_gb`, when given, replaces `--hicache-ratio`."""
    if page_size <= 0 or hicache_ratio <= 0:
        raise ValueError(f"page_size={page_size}, hicache_ratio={hicache_ratio}: pass positive values")
    args = ["--enable-hierarchical-cache", "--page-size", str(page_size)]
    if hicache_size_gb is None:
        args += ["--hicache-ratio", f"{hicache_ratio:g}"]
    else:
        args += ["--hicache-size", f"{hicache_size_gb:g}"]
    args += ["--hicache-write-policy", write_policy, "--hicache-io-backend", io_backend]
    args += ["--hicache-mem-layout", mem_layout]
    return args + (["--hicache-storage-backend", storage_backend] if storage_backend is not None else [])
