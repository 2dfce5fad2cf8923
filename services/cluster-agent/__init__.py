"""tandem.cluster_agent: one per node. Samples GPUs, publishes telemetry, classifies faults
into health transitions, and keeps the node's heartbeat and capacity in KV ``nodes``.

Imports only ``tandem.common`` (never another service, never the CLI) and no torch.
"""
