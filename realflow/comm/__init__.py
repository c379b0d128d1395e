"""Message layer: msgpack codec with zero-copy buffers (codec), keyed-BLAKE2b signing (auth), signed ZMQ
request/reply between master and workers (rpc), heartbeats (heartbeat), and the same-host
shared-memory data plane for tensors (shm). Import the submodules explicitly."""
