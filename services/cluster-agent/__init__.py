"""The cluster agent: one per node. Samples GPUs, publishes telemetry, classifies faults
into health transitions, and keeps the node's heartbeat and capacity in KV ``nodes``."""
