"""tandem.trainer: the coordinator service and the torchrun rank entry point.

Imports only ``tandem.common`` (never another service, never the CLI).
Modules without torch (the coordinator and the node agent import only these):
``service``, ``supervisor``, ``watch``, ``launcher``, ``nodes`` (the coordinator's side
of the node agents), ``node_agent``, ``health``, ``channel``, ``spec``, ``run_metrics``.
With torch (the ranks; ``tandem bench train`` drives them too): ``rank``, ``loop``,
``data``, ``async_ckpt``.
"""
