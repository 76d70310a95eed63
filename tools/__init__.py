"""Tools beside the servers: the command line, model fetch and specialist training, router
training, evaluation and benchmarks. They use the runtime (`fusion.frontdoor.service` and below) and the
servers; the runtime never imports them."""
