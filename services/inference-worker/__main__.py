from tandem.common.runner import main
from tandem.inference_worker.service import InferenceWorker

main(InferenceWorker)
