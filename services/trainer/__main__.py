"""``python -m tandem.trainer``: the coordinator, or this node's trainer agent when
``TANDEM_TRAINER_ROLE=node``. One entry and one image for both: a node runs the very
code its ranks import, and a bad role is refused by the coordinator's settings check,
which names ``TANDEM_TRAINER_ROLE``."""

import os

from tandem.common.runner import main

if os.environ.get("TANDEM_TRAINER_ROLE", "coordinator") == "node":
    from tandem.trainer.node_agent import NodeAgent

    main(NodeAgent)
else:
    from tandem.trainer.service import Trainer

    main(Trainer)
