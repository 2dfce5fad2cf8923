from tandem.common.runner import main
from tandem.trainer.service import Trainer

main(Trainer)
