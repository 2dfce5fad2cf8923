"""tandem.gateway: Tandem's HTTP edge: the generation and training APIs, task status and
SSE, results, routing to clusters, the dashboard.

Imports only ``tandem.common`` (never another service, never the CLI) and no torch.
"""
