"""tandem.inference_worker: pulls its cluster's generation tasks, batches them, runs the
diffusion pipelines, hot-swaps to newly mirrored checkpoints, and hands work back on drain.

Imports only ``tandem.common`` (never another service, never the CLI); torch inside.
"""
