from preft.gateway.server import main

main()
