"""tandem.checkpointer: mirrors written checkpoints to S3, commits, retains, restores.

See ``README.md``; the S3 layout and restore live in ``tandem.common.checkpoints``.
Imports only ``tandem.common`` (never another service, never the CLI) and no torch.
"""
