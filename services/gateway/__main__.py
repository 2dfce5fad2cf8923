from tandem.common.runner import main
from tandem.gateway.service import GatewayService

main(GatewayService)
