from tandem.checkpointer.service import Checkpointer
from tandem.common.runner import main

main(Checkpointer)
