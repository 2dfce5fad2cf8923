from tandem.cluster_agent.service import ClusterAgent
from tandem.common.runner import main

main(ClusterAgent)
