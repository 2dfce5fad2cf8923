"""Tandem trainer: the coordinator service and the torchrun rank entry point.

Modules without torch (the coordinator imports only these): ``service``,
``supervisor``, ``watch``, ``launcher``, ``health``, ``channel``, ``spec``,
``run_metrics``.
With torch (ranks and benchmarks): ``rank``, ``loop``, ``data``, ``async_ckpt``.
"""
