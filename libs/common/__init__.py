"""tandem.common: the only code the services share: the contracts (subjects, streams,
events, errors), the bus, the service runner, settings, logging, metrics, tracing, S3.

It imports no service and not the CLI. torch and diffusers appear only in
``tandem.common.diffusion`` (and inside functions): the lean services never load them.
"""
